"""torch.ops.sgl_kernel.decode_attention_cpu / extend_attention_cpu in plain torch.

SGLang 0.5.23's IntelAMXAttnBackend (srt/layers/attention/intel_amx_backend.py) looks both up as
torch ops when it is constructed, so they are registered as ops (schemas follow its call sites), not
patched in. Paged KV: a request's keys live in k_buffer at the slots req_to_token[row, :seq_len].
Shape legend: T query tokens, H query heads, G = H / Hkv heads per KV head, S keys, D head dim.
Only what the served models need is supported (no sliding window, sinks, cross-attention or
encoder); anything else fails loudly instead of computing something else.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("sgl_kernel", "DEF")  # kept alive for the process: the ops live in it

_LIB.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross, "
    "int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_LIB.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int max_len_extend, float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)


def _unsupported(is_cross: bool, sliding_window: int, encoder_lens, sinks) -> None:
    if is_cross or sliding_window > 0 or encoder_lens is not None or sinks is not None:
        raise NotImplementedError("stand-in attention: cross-attention, sliding windows, encoder lengths and "
                                  "attention sinks are not supported")


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
            sm_scale: float, logit_cap: float) -> torch.Tensor:
    """q [T, H, D], keys/values [S, Hkv, D], visible [T, S] bool or None -> [T, H, Dv] (q's dtype)."""
    t, h, _ = q.shape
    hkv = keys.shape[1]
    qg = q.float().reshape(t, hkv, h // hkv, -1)  # [T, Hkv, G, D]
    scores = torch.einsum("tkgd,skd->tkgs", qg, keys.float()) * sm_scale  # [T, Hkv, G, S]
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgs,skd->tkgd", weights, values.float())  # [T, Hkv, G, Dv]
    return out.reshape(t, h, -1).to(q.dtype)


def decode_attention_cpu(query, k_buffer, v_buffer, k_scale, v_scale, output, key, value, loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross, sliding_window,
                         encoder_lens, sinks) -> None:
    """One new token per sequence: write its K/V at loc (when given), attend over the sequence."""
    _unsupported(is_cross, sliding_window, encoder_lens, sinks)
    if key is not None and value is not None:
        k_buffer[loc.long()] = key.to(k_buffer.dtype)
        v_buffer[loc.long()] = value.to(v_buffer.dtype)
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, :n].long()
        keys, values = k_buffer[slots].float() * k_scale, v_buffer[slots].float() * v_scale
        output[i:i + 1] = _attend(query[i:i + 1], keys, values, None, sm_scale, logit_cap)


def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
                         req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
                         max_len_extend, sm_scale, logit_cap, is_cross, sliding_window, encoder_lens, sinks,
                         tree_mask, is_causal) -> None:
    """Per sequence: its extend tokens attend to the cached prefix (all visible) and to the extend
    tokens; among those, causally, or by tree_mask when given ([n, n] per sequence, back to back:
    row i marks which extend tokens token i sees, as NGRAM's verify trees do)."""
    _unsupported(is_cross, sliding_window, encoder_lens, sinks)
    mask_offset = 0
    for row, total, n, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
                                    extend_start_loc.tolist(), strict=True):
        prefix = total - n
        if k_extend is not None and v_extend is not None:
            slots = req_to_token[row, :prefix].long()
            keys = torch.cat([k_buffer[slots].float() * k_scale, k_extend[start:start + n].float()])
            values = torch.cat([v_buffer[slots].float() * v_scale, v_extend[start:start + n].float()])
        else:  # K/V of the extend tokens were already written by another layer (KV sharing)
            slots = req_to_token[row, :total].long()
            keys, values = k_buffer[slots].float() * k_scale, v_buffer[slots].float() * v_scale
        visible = torch.ones(n, total, dtype=torch.bool)
        if tree_mask is not None:
            block = tree_mask.reshape(-1)[mask_offset:mask_offset + n * n]
            if block.numel() != n * n:
                raise ValueError(f"stand-in extend_attention_cpu: tree_mask holds {tree_mask.numel()} entries, "
                                 "not an [n, n] block per sequence")
            visible[:, prefix:] = block.reshape(n, n).bool()
            mask_offset += n * n
        elif is_causal:
            visible[:, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
        o_extend[start:start + n] = _attend(q_extend[start:start + n], keys, values, visible, sm_scale, logit_cap)


_LIB.impl("decode_attention_cpu", decode_attention_cpu, "CPU")
_LIB.impl("extend_attention_cpu", extend_attention_cpu, "CPU")
