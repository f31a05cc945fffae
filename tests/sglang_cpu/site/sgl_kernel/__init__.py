"""Test-support stand-in for `sgl_kernel`'s CPU ops, so a real SGLang 0.5.23 runs on a CPU here.

TIES THE TESTS TO sglang==0.5.23: the names, argument orders and in-place contracts below are those
its CPU code paths call (read from the 0.5.23 wheel); another SGLang release may call others.
Never imported by the product: only processes started with `tests/sglang_cpu/site` on PYTHONPATH
(the `sglang_cpu` integration tests' `moespec serve`, `moespec bench sglang`) see it.

Why: SGLang's CPU mode (SGLANG_USE_CPU_ENGINE=1) imports these ops when its modules load, and only
the sgl-kernel *CPU source build* has them (the registry's `sglang-kernel` is a CUDA build). Each is
written here in plain torch from what the op must do (its contract, as the Triton/CUDA twin and the
call site define it), batch by batch, for correctness rather than speed.

What it replaces (SGLang module -> op):
- kernels/ops/kvcache/cache_move.py: copy_all_layer_kv_cache_cpu
- srt/mem_cache/allocation.py: assign_req_to_token_pool_cpu
- kernels/ops/speculative/eagle.py: fill_bonus_tokens_cpu, fill_accept_out_cache_loc_cpu
- kernels/ops/speculative/cache_locs.py: assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu
- kernels/ops/speculative/spec_tree.py: build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu
- kernels/ops/speculative/multi_layer_eagle.py: rotate_input_ids_cpu
- kernels/ops/speculative/reconstruct_tree.py (NGRAM): sgl_kernel.speculative.reconstruct_indices_from_tree_mask
- srt/layers/attention/intel_amx_backend.py: build_draft_decode_metadata_cpu (draft chains and trees),
  and torch.ops.sgl_kernel.decode_attention_cpu / extend_attention_cpu (registered by attention.py)
Deliberately absent: `convert_weight_packed`. SGLang switches its AMX compute paths
(weight_packed_linear, fused_experts_cpu, rmsnorm_cpu, ...) on only when that op exists, so without
it SGLang runs its own pure-torch fallbacks (native MoE, forward_native norms, activations, rope).
The post-import patches SGLang additionally needs on this machine live in `../sitecustomize.py`.
"""

from __future__ import annotations

import ctypes

import torch

from sgl_kernel import attention as _attention  # noqa: F401  (registers torch.ops.sgl_kernel.*)

# -- KV cache and token-pool bookkeeping ---------------------------------------------------------


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every KV buffer (base address data_ptrs[i], row size strides[i] bytes) copy row src_loc[j]
    onto row tgt_loc[j]. The buffers are only known by address, hence memmove."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Request i's token slots [start_i, end_i) in its req_to_token row take the next
    (end_i - start_i) entries of out_cache_loc (requests packed back to back)."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The inverse read: out_cache_loc, packed per request, gets req_to_token[row_i, start_i:end_i]."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        out_cache_loc[taken:taken + n] = req_to_token[row, start:end].to(out_cache_loc.dtype)
        taken += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """Request i's draft slots: the topk * num_steps req_to_token entries from seq_lens[i] on, written
    to out_cache_loc[i * topk * num_steps:]."""
    width = topk * num_steps
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[row, start:start + width].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """The req_to_token table the draft's decode steps attend through: one row per (request,
    candidate), addressed by arange(bs * topk). Candidate t of request i reads the request's prefix
    (its first seq_lens[i] slots) and then its own run of draft slots, the num_steps entries from
    seq_lens[i] + t * num_steps on (assign_draft_cache_locs_contiguous gives request i the topk *
    num_steps slots after its prefix, candidate by candidate); the backend attends the first
    seq_lens[i] + step + 1 entries of the row. For a chain (topk 1) that is the request's own row."""
    rows = req_to_token[req_pool_indices.long()]
    table = torch.zeros((rows.shape[0] * topk, pool_len), dtype=req_to_token.dtype)
    for i, start in enumerate(seq_lens.tolist()):
        for t in range(topk):
            own = rows[i, start + t * num_steps:start + (t + 1) * num_steps]
            table[i * topk + t, :start] = rows[i, :start]
            table[i * topk + t, start:start + own.numel()] = own
    return table


# -- speculative decoding: accept / bonus tokens -------------------------------------------------


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus one)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Compact the cache slots of accepted tokens: for every accept_index entry that is not -1, in
    order, append out_cache_loc[that entry]."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def rotate_input_ids_cpu(input_ids: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                         topk_index: torch.Tensor, select_index: torch.Tensor | None) -> None:
    """Per request: shift its extend tokens left by one and put its new token last (or at
    select_index[i] when given), in place."""
    for i, (start, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist(), strict=True)):
        if n <= 0:
            continue
        input_ids[start:start + n - 1] = input_ids[start + 1:start + n].clone()
        last = int(select_index[i]) if select_index is not None else start + n - 1
        input_ids[last] = topk_index.reshape(-1)[i]


# -- speculative decoding: draft trees -----------------------------------------------------------


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor, positions: torch.Tensor,
                                    retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor,
                                    retrieve_next_sibling: torch.Tensor, topk: int, depth: int,
                                    draft_token_num: int, tree_mask_mode: int) -> None:
    """Turn the draft's selected candidates into a verify tree, per request b:
    node 0 is the last verified token; node i >= 1 is candidate selected_index[b, i-1], whose parent
    is the node holding candidate parent_list[b, selected_index[b, i-1] // topk] (the root when that
    quotient is 0). Outputs (in place): retrieve_index[b, i] = b*n + i; retrieve_next_token[b, p] =
    p's first child, retrieve_next_sibling[b, c] = c's next sibling (children in ascending order);
    positions[b*n + i] = seq_len + depth of i; tree_mask rows = root, self and ancestors visible
    (FULL_MASK rows span prefix + n columns, prefix left as given; QLEN_ONLY rows span n)."""
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    # Flat views: the callers' tensors are [bs, n] or [bs * n]; the addressing is b * n + i either way.
    retrieve_index, retrieve_next_token = retrieve_index.view(-1, n), retrieve_next_token.view(-1, n)
    retrieve_next_sibling = retrieve_next_sibling.view(-1, n)
    tree_mask, positions = tree_mask.view(-1), positions.view(-1)
    parent_list = parent_list.reshape(len(seq_lens), -1)
    selected_index = selected_index.reshape(len(seq_lens), -1)
    full_offset = 0  # FULL_MASK: requests' blocks are n rows of (seq_len + n) columns, back to back
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b].tolist()
        node_of = {cand: i + 1 for i, cand in enumerate(selected[:n - 1])}

        def parent_node(i: int, b: int = b, selected: list = selected, node_of: dict = node_of) -> int | None:
            quotient = selected[i - 1] // topk
            if quotient == 0:
                return 0
            return node_of.get(int(parent_list[b, quotient]))

        parents = [None] + [parent_node(i) for i in range(1, n)]
        for i in range(n - 1, 0, -1):  # descending, so each parent ends up pointing at its first child
            retrieve_index[b, i] = b * n + i
            p = parents[i]
            if p is None:
                continue
            previous = int(retrieve_next_token[b, p])
            retrieve_next_token[b, p] = i
            if previous != -1:
                retrieve_next_sibling[b, i] = previous
        retrieve_index[b, 0] = b * n
        for i in range(n):
            visible = [0]
            node, steps = i, 0
            while node not in (0, None) and steps < depth:
                visible.append(node)
                node, steps = parents[node], steps + 1
            positions[b * n + i] = seq_len + steps
            full_mask = tree_mask_mode == 0
            row = full_offset + i * (seq_len + n) + seq_len if full_mask else b * n * n + i * n
            tree_mask[row:row + n] = False
            for j in visible:
                tree_mask[row + j] = True
        full_offset += n * (seq_len + n)


def verify_tree_greedy_cpu(*, predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy tree walk per request: from the root, go down to the child whose candidate token equals
    the target's argmax at the last accepted node, as long as one does. accept_index[b] lists the
    accepted nodes' global indices (root first), accept_token_num[b] the accepted drafts, and
    predicts[node] the target token at every accepted node (the last one's is the bonus token)."""
    flat_target = target_predict.reshape(-1)
    depth_max = accept_index.shape[1]
    bs = candidates.shape[0]
    retrive_index, retrive_next_token = retrive_index.view(bs, -1), retrive_next_token.view(bs, -1)
    retrive_next_sibling, predicts = retrive_next_sibling.view(bs, -1), predicts.view(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, depth_max):
            target = int(flat_target[last])
            child = int(retrive_next_token[b, node])
            while child != -1 and int(candidates[b, child]) != target:
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, child])
            accept_index[b, accepted] = last
            node = child
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]
