"""All decoder layers of a Qwen2-MoE pass in one C call (`Kernels.decoder_layers`).

Why: with attention and the MoE block each one kernel call, a one-token decode step of the shipped
model still spent about half of its forward pass between the calls: per layer the two wrappers'
checks and output tensors, the post-attention norm as a module call, the residual add, the list of
routed ids; about 200 microseconds per step against about 180 in the kernels themselves. Here the
layer loop runs in C: the same kernels in the same order (attention_block, rms_norm, moe_block, the
residual add), so the hidden states and routed ids are bitwise those of the Python loop.

`DecoderStack` holds every layer's constant arguments, checked once when the model is fused (it
keeps pointers into the layers' packed weights: they must not move or be replaced afterwards); a
pass's positions, slots and cache are checked by `AttentionPass` as for the per-layer calls.
"""

from __future__ import annotations

import ctypes

from service.engine import csrc

SOURCE = csrc.read("decoder.c")

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecoderLayer(ctypes.Structure):
    """decoder.c's struct decoder_layer, field for field."""

    _fields_ = [("attn_norm_w", _ptr), ("qkv_wt", _ptr), ("qkv_b", _ptr), ("o_wt", _ptr),
                ("A", _i64), ("K", _i64), ("D", _i64), ("attn_eps", _f32), ("attn_fmt", _int),
                ("mlp_norm_w", _ptr), ("mlp_eps", _f32), ("moe_fmt", _int),
                ("router", _ptr), ("gate_up_t", _ptr), ("down_t", _ptr), ("shared_gate_up_t", _ptr),
                ("shared_down_t", _ptr),
                ("E", _i64), ("m", _i64), ("gate_up_stride", _i64), ("down_stride", _i64), ("I", _i64), ("Is", _i64),
                ("norm_topk", _int)]


class DecoderStack:
    """The layers' arguments for `Kernels.decoder_layers`, from their fused blocks (AttentionWeights,
    the post-attention RMSNorm, MoeBlock)."""

    def __init__(self, layers):
        blocks = [(layer.self_attn.block, layer.post_attention_layernorm, layer.mlp.block) for layer in layers]
        if not blocks or any(a is None or moe is None for a, _, moe in blocks):
            raise ValueError("decoder_layers: every layer needs its fused attention and MoE blocks")
        H = blocks[0][0].H
        if any(a.H != H or moe.H != H or norm.weight.shape != (H,) for a, norm, moe in blocks):
            raise ValueError("decoder_layers: the layers disagree on the hidden size")
        self.H, self.L = H, len(blocks)
        self.m = blocks[0][2].top_k
        if any(moe.top_k != self.m for _, _, moe in blocks):
            raise ValueError("decoder_layers: every layer must route the same number of experts")
        self.norms = [norm.weight.detach().contiguous() for _, norm, _ in blocks]  # alive while in use
        self.array = (DecoderLayer * self.L)()
        for entry, (attn, norm, moe), norm_weight in zip(self.array, blocks, self.norms, strict=True):
            (entry.attn_norm_w, entry.attn_eps, entry.qkv_wt, entry.qkv_b, entry.A, entry.K, entry.D,
             entry.attn_fmt) = attn.args
            entry.o_wt = attn.o_ptr
            entry.mlp_norm_w, entry.mlp_eps = norm_weight.data_ptr(), float(norm.eps)
            (entry.router, entry.E, entry.m, entry.norm_topk, entry.gate_up_t, entry.gate_up_stride, entry.down_t,
             entry.down_stride, entry.I, entry.shared_gate_up_t, entry.shared_down_t, entry.Is,
             entry.moe_fmt) = moe.args
        self.kv = (blocks[0][0].K, blocks[0][0].D)
        if any(self.kv != (a.K, a.D) for a, _, _ in blocks):
            raise ValueError("decoder_layers: the layers disagree on kv heads or head dim")
