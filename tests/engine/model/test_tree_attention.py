"""A draft tree verified in one pass: every node's logits are those of its own path, checked against
transformers over prefix + path (the independent oracle) and bitwise against the same path decoded as
a chain by the same kernels; a pass mixing a tree window with chain windows of other slots; the
kernel's checks of the tree's shape."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import library as kernels
from service.engine.kernels.pool import KernelThreads
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

transformers = pytest.importorskip("transformers")

# Window-local parents (-1: the window's first token, the last committed one).
WIDE = [-1, 0, 0, 0, 1, 2, 2, 4, 7]  # three children of the root, a chain of depth 4 under the first
SMALL = [-1, 0, 0, 1]  # four positions: the attention splits by kv head over a pool


def path_of(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.fixture(scope="module")
def oracle():
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def built():
    built = kernels.build()
    assert built is not None, "the fused kernels did not build"
    return built


def load(built, math: str = "fp32", threads: int = 1):
    pool = KernelThreads(built.pool(threads)) if threads > 1 else KernelThreads(None)
    return load_for_inference(DEFAULT_TARGET_DIR, kernels=built, math=math, kernel_threads=pool)


def tree_tokens(parents: list[int], seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (len(parents),), generator=torch.Generator().manual_seed(seed))


def oracle_last(oracle, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return oracle(ids[None]).logits[0, -1]


@pytest.mark.parametrize("parents,threads", [(WIDE, 1), (SMALL, 2), (WIDE, 2)], ids=["wide", "small-pool", "wide-pool"])
def test_every_node_of_a_tree_gets_the_logits_of_its_own_path(oracle, built, parents, threads):
    model = load(built, threads=threads)
    prefix = tree_tokens([0] * 30, 1, model.cfg.vocab_size)
    tokens = tree_tokens(parents, 2, model.cfg.vocab_size)
    cache = KVCache(model.cfg, 64)
    with torch.no_grad():
        model.forward(prefix[:-1], 0, cache)
        window = torch.cat([prefix[-1:], tokens[1:]])  # the window opens with the last committed token
        batch = RaggedBatch.build([0], [len(prefix) - 1], [len(parents)], trees=[parents])
        got = model.forward_ragged(window, batch, cache).logits
    for node in range(len(parents)):
        path = window[path_of(parents, node)]
        want = oracle_last(oracle, torch.cat([prefix[:-1], path]))
        torch.testing.assert_close(got[node], want, atol=2e-4, rtol=1e-4, msg=f"node {node}")


def test_a_node_is_bitwise_its_path_decoded_as_a_chain_beside_other_slots(built):
    """Default arithmetic (AMX or bf16 where offered): the tree window shares its pass with a chain
    window and a one-token step of other slots, and each node's logits are the bits the same kernels
    give its path as a chain window alone."""
    model = load_for_inference(DEFAULT_TARGET_DIR, kernels=built, math=built.default_math())
    V = model.cfg.vocab_size
    prefix, tokens = tree_tokens([0] * 20, 3, V), tree_tokens(WIDE, 4, V)
    others = [tree_tokens([0] * 12, 5, V), tree_tokens([0] * 9, 6, V)]
    window = torch.cat([prefix[-1:], tokens[1:]])
    cache = KVCache(model.cfg, 64, slots=3)
    with torch.no_grad():
        model.forward(prefix[:-1], 0, cache, slot=1)
        model.forward(others[0][:8], 0, cache, slot=0)
        model.forward(others[1][:8], 0, cache, slot=2)
        batch = RaggedBatch.build([0, 1, 2], [8, len(prefix) - 1, 8], [4, len(WIDE), 1],
                                  trees=[None, WIDE, None])
        got = model.forward_ragged(torch.cat([others[0][8:], window, others[1][8:]]), batch, cache).logits
        tree_rows = got[4:4 + len(WIDE)]
        for node in range(len(WIDE)):
            path = window[path_of(WIDE, node)]
            alone = KVCache(model.cfg, 64)
            model.forward(prefix[:-1], 0, alone)
            chain = model.forward(path, len(prefix) - 1, alone).logits[-1]
            assert torch.equal(tree_rows[node], chain), f"node {node}"


def test_without_its_tree_the_same_window_reads_other_branches(oracle, built):
    """Negative control: the same tokens verified as a chain give a branch node the logits of a
    different sequence (the mask and the rope positions are what make the tree right)."""
    model = load(built)
    prefix, tokens = tree_tokens([0] * 30, 1, model.cfg.vocab_size), tree_tokens(WIDE, 2, model.cfg.vocab_size)
    window = torch.cat([prefix[-1:], tokens[1:]])
    cache = KVCache(model.cfg, 64)
    with torch.no_grad():
        model.forward(prefix[:-1], 0, cache)
        got = model.forward(window, len(prefix) - 1, cache).logits
    node = 5  # parent 2: its chain window also shows it nodes 1, 3 and 4
    want = oracle_last(oracle, torch.cat([prefix[:-1], window[path_of(WIDE, node)]]))
    assert (got[node] - want).abs().max() > 1e-2


@pytest.mark.parametrize("parents,message", [
    ([0, 0, 1], "-1 first"),
    ([-1, 2, 0], "before its child"),
    ([-1, 0], "3 parents"),
])
def test_a_malformed_tree_is_refused_naming_the_rule(parents, message):
    with pytest.raises(ValueError, match=message):
        RaggedBatch.build([0], [5], [3], trees=[parents])


def test_the_eager_step_refuses_a_tree_pass():
    model = load_for_inference(DEFAULT_TARGET_DIR)  # no kernels: the eager step
    cache = KVCache(model.cfg, 16)
    batch = RaggedBatch.build([0], [0], [3], trees=[[-1, 0, 0]])
    with torch.no_grad(), pytest.raises(ValueError, match="fused attention"):
        model.forward_ragged(torch.tensor([1, 2, 3]), batch, cache)


def test_a_tree_grown_a_depth_per_pass_gives_the_whole_tree_pass_bits(built):
    """A drafter grows its tree a depth per pass: each pass holds only the new nodes, their ancestors'
    keys already in the cache (explicit paths). Every node's logits are the whole-tree pass's bits."""
    model = load_for_inference(DEFAULT_TARGET_DIR, kernels=built, math=built.default_math())
    V = model.cfg.vocab_size
    prefix, tokens = tree_tokens([0] * 20, 7, V), tree_tokens(WIDE, 8, V)
    window = torch.cat([prefix[-1:], tokens[1:]])
    b = len(prefix) - 1
    depth = [len(path_of(WIDE, i)) - 1 for i in range(len(WIDE))]
    with torch.no_grad():
        whole_cache = KVCache(model.cfg, 64)
        model.forward(prefix[:-1], 0, whole_cache)
        whole = model.forward_ragged(window, RaggedBatch.build([0], [b], [len(WIDE)], trees=[WIDE]), whole_cache).logits
        cache = KVCache(model.cfg, 64)
        model.forward(prefix[:-1], 0, cache)
        grown = torch.empty_like(whole)
        for d in range(max(depth) + 1):
            nodes = [i for i in range(len(WIDE)) if depth[i] == d]
            paths = [[b + j for j in path_of(WIDE, i)] for i in nodes]
            batch = RaggedBatch.build([0] * len(nodes), [b + i for i in nodes], [1] * len(nodes), paths=paths)
            grown[nodes] = model.forward_ragged(window[nodes], batch, cache).logits
    assert torch.equal(grown, whole)


@pytest.mark.parametrize("paths,message", [
    ([[5], [5, 7]], "own position"),  # the second token sits at 6
    ([[5], [-1, 6]], "window's first row"),
])
def test_malformed_paths_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        RaggedBatch.build([0], [5], [2], paths=paths)


def test_the_kernel_checks_a_tree_tensor_it_is_handed(built):
    from service.engine.kernels.attention import AttentionPass

    model = load(built)
    cache = KVCache(model.cfg, 16)
    positions, slots = torch.tensor([3, 4]), torch.tensor([0, 0])
    bad = torch.tensor([2, 4, 0, 3, 1, 3, 40])  # token 1's path runs to row 40, past the cache
    with pytest.raises(ValueError, match="must end at its position"):
        AttentionPass(positions, slots, cache.k, cache.v, model.rope_cos, model.rope_sin, tree=bad)
    with pytest.raises(ValueError, match="outside the tree tensor"):
        AttentionPass(positions, slots, cache.k, cache.v, model.rope_cos, model.rope_sin, tree=torch.tensor([2, 9]))
