"""`moespec serve --backend sglang --device cpu` where SGLang is installed but its CPU kernel ops
(sgl_kernel) are not, as with every published SGLang: one line, exit 2, pointing at the torch
backend, instead of a traceback from SGLang's start-up. With the ops importable (the test
stand-ins on sys.path) the check lets the start go on."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from service.cli import main
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend.preflight import CPU_KERNELS, SGLangUnavailable, require_cpu_kernels
from tests.sglang.test_sglang_errors import model_dir

STAND_INS = Path(__file__).resolve().parents[1] / "sglang_cpu" / "site"
KERNELS_HERE = importlib.util.find_spec(CPU_KERNELS) is not None


@pytest.mark.skipif(KERNELS_HERE, reason="sgl_kernel is importable here")
def test_serve_on_cpu_without_the_kernel_ops_exits_2_with_one_line_naming_the_torch_backend(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sglang_cli, "import_sglang", lambda: types.SimpleNamespace(__version__="0.5.23"))
    for name in ("SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE"):  # serve sets SGLang's CPU switch:
        monkeypatch.setenv(name, "")  # registered with monkeypatch, so it is undone after the test
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "sglang", "--device", "cpu", "--model-path", str(model_dir(tmp_path / "t")),
              "--speculative-algorithm", "NGRAM"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.count("\n") == 0 and err.startswith("moespec serve: error:")
    assert "sgl_kernel" in err and "--backend torch" in err


@pytest.mark.skipif(KERNELS_HERE, reason="sgl_kernel is importable here")
def test_the_check_refuses_a_missing_module_and_accepts_the_stand_ins(monkeypatch):
    with pytest.raises(SGLangUnavailable, match="--backend torch"):
        require_cpu_kernels()
    monkeypatch.syspath_prepend(str(STAND_INS))
    importlib.invalidate_caches()
    require_cpu_kernels()  # found, not imported
    assert CPU_KERNELS not in sys.modules


# -- the stand-in EAGLE CPU ops, each against a plain re-statement of its definition ----------------
# The definitions are those of SGLang 0.5.23's Triton twins and call sites (kernels/ops/speculative/
# eagle.py, cache_locs.py, spec_tree.py, multi_layer_eagle.py; layers/attention/intel_amx_backend.py),
# restated here independently of the stand-ins' loops: masks, cumulative sums and chain arithmetic.


@pytest.fixture(scope="module")
def kernels():
    """The stand-in package, imported for this module only (the preflight tests above need it absent)."""
    sys.path.insert(0, str(STAND_INS))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(CPU_KERNELS)
    finally:
        sys.path.remove(str(STAND_INS))
    yield module
    for name in [n for n in sys.modules if n == CPU_KERNELS or n.startswith(CPU_KERNELS + ".")]:
        del sys.modules[name]


def pool(requests: int, pool_len: int, seed: int) -> torch.Tensor:
    """A req_to_token table of distinct KV slots, int32 as SGLang's."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(requests * pool_len * 2, generator=g)[:requests * pool_len].view(requests, pool_len).int()


def packed_ranges(req_to_token: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, end: torch.Tensor):
    """req_to_token[rows[i], start[i]:end[i]] for every i, packed request after request (row-major mask)."""
    table = req_to_token[rows.long()]
    column = torch.arange(table.shape[1]).unsqueeze(0)
    return table[(column >= start.unsqueeze(1)) & (column < end.unsqueeze(1))].long()


def test_assign_extend_cache_locs_packs_each_requests_slot_range(kernels):
    req_to_token = pool(5, 16, seed=1)
    rows, start, end = torch.tensor([3, 0, 4]), torch.tensor([2, 0, 7]), torch.tensor([6, 3, 7])
    out = torch.full((7,), -5, dtype=torch.int64)
    kernels.assign_extend_cache_locs_cpu(rows, req_to_token, start, end, out, 16)
    assert out.tolist() == packed_ranges(req_to_token, rows, start, end).tolist()


def test_assign_draft_cache_locs_contiguous_takes_topk_times_steps_slots_after_the_prefix(kernels):
    req_to_token = pool(4, 32, seed=2)
    rows, seq_lens, topk, steps = torch.tensor([2, 1]), torch.tensor([5, 11]), 1, 3
    out = torch.full((2 * topk * steps,), -5, dtype=torch.int64)
    kernels.assign_draft_cache_locs_contiguous_cpu(rows, req_to_token, seq_lens, out, 32, topk, steps)
    assert out.tolist() == packed_ranges(req_to_token, rows, seq_lens, seq_lens + topk * steps).tolist()


def test_build_draft_decode_metadata_for_a_chain_is_each_requests_own_row(kernels):
    req_to_token = pool(6, 8, seed=3)
    rows = torch.tensor([5, 2, 0])
    seq_lens = [3, 4, 1]
    draft = kernels.build_draft_decode_metadata_cpu(req_to_token, rows, torch.tensor(seq_lens), 1, 3, 8)
    # Row r of the draft table is what arange(bs * topk)[r] addresses: request r's prefix and draft slots.
    assert all(torch.equal(draft[r, :n + 3], req_to_token[rows[r], :n + 3]) for r, n in enumerate(seq_lens))


@pytest.mark.parametrize(("topk", "steps"), [(2, 3), (3, 2), (4, 4)])
def test_build_draft_decode_metadata_for_a_tree_gives_each_candidate_its_own_draft_slots(kernels, topk, steps):
    """The definition (SGLang's generate_draft_decode_kv_indices, page size 1): at draft step s, candidate
    t of request i attends its prefix req_to_token[row_i, :seq_len_i], then the s + 1 slots from
    seq_len_i + t * steps on; the backend reads the first seq_len_i + s + 1 entries of row i * topk + t."""
    req_to_token = pool(6, 40, seed=5)
    rows, seq_lens = torch.tensor([5, 2, 0]), torch.tensor([3, 7, 1])
    draft = kernels.build_draft_decode_metadata_cpu(req_to_token, rows, seq_lens, topk, steps, 40)
    assert draft.shape == (3 * topk, 40)
    for i, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        for t in range(topk):
            for s in range(steps):
                own = seq_len + t * steps + torch.arange(s + 1)
                want = torch.cat([req_to_token[row, :seq_len], req_to_token[row, own]])
                assert torch.equal(draft[i * topk + t, :seq_len + s + 1], want), (i, t, s)


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token(kernels):
    accept_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    accept_lens = torch.tensor([2, 4, 1])  # the bonus token included
    bonus = torch.zeros(3, dtype=torch.int64)
    kernels.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == accept_tokens[torch.arange(3), accept_lens - 1].tolist() == [12, 24, 31]


def test_fill_accept_out_cache_loc_compacts_the_accepted_slots_in_order(kernels):
    accept_index = torch.tensor([[0, 1, -1, -1], [4, 5, 6, -1], [8, -1, -1, -1]])
    out_cache_loc = torch.arange(100, 112)
    got = torch.full((12,), -5, dtype=torch.int64)
    kernels.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    # The Triton definition: entry p (not -1) goes to slot (number of non -1 entries before p).
    flat = accept_index.reshape(-1)
    kept = flat != -1
    destination = torch.cumsum(kept.long(), 0) - 1
    expected = torch.full((12,), -5, dtype=torch.int64)
    expected[destination[kept]] = out_cache_loc[flat[kept]]
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("select", [False, True], ids=["last", "select_index"])
def test_rotate_input_ids_shifts_each_request_left_and_puts_its_new_token(kernels, select):
    ids = torch.arange(10, 19)  # requests of 4, 2 and 3 extend tokens
    start, lens, new = torch.tensor([0, 4, 6]), torch.tensor([4, 2, 3]), torch.tensor([[90], [91], [92]])
    chosen = torch.tensor([1, 5, 7]) if select else None
    expected = ids.tolist()
    for i, (s, n) in enumerate(zip(start.tolist(), lens.tolist(), strict=True)):
        expected[s:s + n] = ids.tolist()[s + 1:s + n] + [ids.tolist()[s + n - 1]]
        expected[int(chosen[i]) if select else s + n - 1] = int(new[i])
    kernels.rotate_input_ids_cpu(ids, start, lens, new, chosen)
    assert ids.tolist() == expected


def chain_inputs(bs: int, steps: int):
    """What SGLang's organize_draft_results hands the tree builder for topk 1: every step's one candidate
    selected in order, candidate c's parent candidate c - 1 (parent_list [-1, 0, 1, ...])."""
    parent_list = torch.arange(-1, steps - 1).repeat(bs, 1)
    selected = torch.arange(steps).repeat(bs, 1)
    return parent_list, selected


def test_build_tree_for_a_chain_is_the_chain(kernels):
    """topk 1, CPU's QLEN_ONLY mask: node i sits at seq_len + i, sees nodes 0..i, its next token is i + 1."""
    bs, steps = 3, 3
    n = steps + 1
    seq_lens = torch.tensor([7, 2, 12])
    parent_list, selected = chain_inputs(bs, steps)
    mask = torch.ones(bs * n * n, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, next_token, next_sibling = torch.full((3, bs, n), -1, dtype=torch.int64)
    kernels.build_tree_kernel_efficient_cpu(parent_list, selected, seq_lens, mask, positions, index, next_token,
                                            next_sibling, 1, steps, n, 1)  # 1: TreeMaskMode.QLEN_ONLY
    nodes = torch.arange(n)
    assert positions.view(bs, n).tolist() == (seq_lens.unsqueeze(1) + nodes).tolist()
    assert index.tolist() == (torch.arange(bs).unsqueeze(1) * n + nodes).tolist()
    assert next_token.tolist() == [[*range(1, n), -1]] * bs
    assert next_sibling.tolist() == [[-1] * n] * bs
    assert mask.view(bs, n, n).tolist() == [torch.ones(n, n, dtype=torch.bool).tril().tolist()] * bs


def test_verify_tree_greedy_on_a_chain_accepts_the_longest_matching_prefix(kernels):
    """Accept drafts while draft i + 1 equals the target's argmax after node i; the predicts of the
    accepted nodes are the target's tokens (the last one the bonus)."""
    bs, n = 3, 4
    candidates = torch.tensor([[5, 6, 7, 8], [5, 16, 17, 18], [5, 26, 27, 28]])  # node 0: the last verified token
    target = torch.tensor([[6, 7, 9, 1], [3, 17, 18, 2], [26, 27, 28, 4]]).reshape(-1)  # argmax after each node
    index, next_token, next_sibling = (torch.arange(bs * n).view(bs, n), torch.tensor([[1, 2, 3, -1]] * bs),
                                       torch.full((bs, n), -1))
    predicts, accept_index = torch.zeros(bs * n, dtype=torch.int64), torch.full((bs, n), -1, dtype=torch.int64)
    accept_num = torch.zeros(bs, dtype=torch.int64)
    kernels.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                   candidates=candidates, retrive_index=index, retrive_next_token=next_token,
                                   retrive_next_sibling=next_sibling, target_predict=target)
    matches = candidates[:, 1:] == target.view(bs, n)[:, :-1]  # draft i + 1 against the argmax after node i
    accepted = torch.cumprod(matches.long(), dim=1).sum(dim=1)  # the matching prefix's length
    assert accept_num.tolist() == accepted.tolist() == [2, 0, 3]
    expected_predicts = torch.zeros(bs * n, dtype=torch.int64)
    for b, a in enumerate(accepted.tolist()):
        assert accept_index[b].tolist() == [b * n + j for j in range(a + 1)] + [-1] * (n - a - 1)
        expected_predicts[b * n:b * n + a + 1] = target[b * n:b * n + a + 1]
    assert predicts.tolist() == expected_predicts.tolist()


# A topk 2, 3-step EAGLE draft, written out by hand. Draft step 0 offers candidates 0, 1 (children of the
# root); step 1 expands both: 2, 3 of candidate 0 and 4, 5 of candidate 1; step 2 expands candidates 3 and
# 4: 6, 7 of 3 and 8, 9 of 4. SGLang's parent_list names each expanded candidate ([-1] for the root's
# expansion), so candidate c's parent is parent_list[c // topk]. The 5 best by score, sorted, are verified:
# candidates 0, 1, 3, 4, 6 as nodes 1..5 behind node 0 (the last verified token):
#             0
#           /   \
#          1     2          node: 1 = c0, 2 = c1, 3 = c3 (of c0), 4 = c4 (of c1), 5 = c6 (of c3)
#          |     |
#          3     4
#          |
#          5
TREE_PARENT_LIST = [-1, 0, 1, 3, 4]
TREE_SELECTED = [0, 1, 3, 4, 6]
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]
TREE_DEPTHS = [0, 1, 1, 2, 2, 3]


def test_build_tree_for_a_topk_2_draft_is_the_tree_written_out_by_hand(kernels):
    n, seq_len = 6, 9
    mask = torch.ones(n * n, dtype=torch.bool)
    positions = torch.empty(n, dtype=torch.int64)
    index, next_token, next_sibling = torch.full((3, 1, n), -1, dtype=torch.int64)
    kernels.build_tree_kernel_efficient_cpu(torch.tensor([TREE_PARENT_LIST]), torch.tensor([TREE_SELECTED]),
                                            torch.tensor([seq_len]), mask, positions, index, next_token,
                                            next_sibling, 2, 3, n, 1)  # 1: TreeMaskMode.QLEN_ONLY
    assert positions.tolist() == [seq_len + d for d in TREE_DEPTHS]
    assert index.tolist() == [list(range(n))]
    assert next_token.tolist() == [[1, 3, 4, 5, -1, -1]]  # first children
    assert next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]  # node 2 follows node 1 under the root
    visible = [[False] * n for _ in range(n)]  # each node sees the root, its ancestors and itself
    for node in range(n):
        i = node
        while i >= 0:
            visible[node][i] = True
            i = TREE_PARENTS[i]
    assert mask.view(n, n).tolist() == visible


def test_verify_tree_greedy_walks_down_the_matching_child_sibling_by_sibling(kernels):
    """Over the hand-written tree: the target's argmax after the root is node 2's token (the root's second
    child, reached through node 1's sibling link), after node 2 node 4's, after node 4 no node's: 2 drafts
    accepted, nodes 0, 2, 4, and the predicts there are the target's tokens (the last the bonus)."""
    n = 6
    candidates = torch.tensor([[50, 61, 62, 71, 72, 81]])
    target = torch.tensor([62, 1, 72, 2, 99, 3])  # argmax after each node
    index, next_token = torch.arange(n).view(1, n), torch.tensor([[1, 3, 4, 5, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1, -1, -1]])
    predicts, accept_index = torch.zeros(n, dtype=torch.int64), torch.full((1, 4), -1, dtype=torch.int64)
    accept_num = torch.zeros(1, dtype=torch.int64)
    kernels.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                   candidates=candidates, retrive_index=index, retrive_next_token=next_token,
                                   retrive_next_sibling=next_sibling, target_predict=target)
    assert accept_num.tolist() == [2] and accept_index.tolist() == [[0, 2, 4, -1]]
    assert predicts.tolist() == [62, 0, 72, 0, 99, 0]
