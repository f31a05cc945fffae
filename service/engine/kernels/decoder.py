"""All decoder layers of a pass in one C call (`Kernels.decoder_layers`), for the Qwen2-MoE target
and the dense Qwen2 draft.

Why: with attention and the MoE block each one kernel call, a one-token decode step of the shipped
model still spent about as long between the calls as in them (per layer the two wrappers' checks and
output tensors, the post-attention norm as a module call, the residual add, the list of routed ids;
figures in docs/engine.md). Here the
layer loop runs in C: the same kernels in the same order (attention_block, rms_norm, moe_block, the
residual add; a dense layer's MLP through swiglu_experts as MLP.forward calls it), so the hidden
states and routed ids are bitwise those of the Python loop.

`DecoderStack` holds every layer's constant arguments, checked once when the model is fused (it
keeps pointers into the layers' packed weights: they must not move or be replaced afterwards); a
pass's positions, slots and cache are checked by `AttentionPass` as for the per-layer calls.
"""

from __future__ import annotations

import ctypes

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecoderLayer(ctypes.Structure):
    """decoder.c's struct decoder_layer, field for field."""

    _fields_ = [("attn_norm_w", _ptr), ("qkv_wt", _ptr), ("qkv_b", _ptr), ("o_wt", _ptr),
                ("A", _i64), ("K", _i64), ("D", _i64), ("attn_eps", _f32), ("attn_fmt", _int),
                ("mlp_norm_w", _ptr), ("mlp_eps", _f32), ("moe_fmt", _int),
                ("router", _ptr), ("gate_up_t", _ptr), ("down_t", _ptr), ("shared_gate_up_t", _ptr),
                ("shared_down_t", _ptr),
                ("E", _i64), ("m", _i64), ("gate_up_stride", _i64), ("down_stride", _i64), ("I", _i64), ("Is", _i64),
                ("norm_topk", _int), ("dense", _int)]


class DecoderStack:
    """The layers' arguments for `Kernels.decoder_layers`, from their fused blocks: AttentionWeights,
    the post-attention RMSNorm, and MoeBlock (an MoE model) or the MLP's packed weights (a dense one)."""

    def __init__(self, layers, moe: bool):
        attention = [layer.self_attn.block for layer in layers]
        if not layers or any(a is None for a in attention):
            raise ValueError("decoder_layers: every layer needs its fused attention block")
        if moe and any(layer.mlp.block is None for layer in layers):
            raise ValueError("decoder_layers: every layer needs its fused MoE block")
        if not moe and any(not layer.mlp.kernel_weights for layer in layers):
            raise ValueError("decoder_layers: every layer needs its MLP's packed weights")
        self.H, self.L, self.moe = attention[0].H, len(layers), moe
        self.kv = (attention[0].K, attention[0].D)
        if any(a.H != self.H or layer.post_attention_layernorm.weight.shape != (self.H,) or self.kv != (a.K, a.D)
               for a, layer in zip(attention, layers, strict=True)):
            raise ValueError("decoder_layers: the layers disagree on the hidden size, kv heads or head dim")
        self.m = layers[0].mlp.block.top_k if moe else 0
        if moe and any(layer.mlp.block.top_k != self.m or layer.mlp.block.H != self.H for layer in layers):
            raise ValueError("decoder_layers: every MoE layer must route the same number of experts")
        self.norms = [layer.post_attention_layernorm.weight.detach().contiguous() for layer in layers]  # kept alive
        self.array = (DecoderLayer * self.L)()
        for entry, attn, layer, norm_weight in zip(self.array, attention, layers, self.norms, strict=True):
            (entry.attn_norm_w, entry.attn_eps, entry.qkv_wt, entry.qkv_b, entry.A, entry.K, entry.D,
             entry.attn_fmt) = attn.args
            entry.o_wt = attn.o_ptr
            entry.mlp_norm_w, entry.mlp_eps = norm_weight.data_ptr(), float(layer.post_attention_layernorm.eps)
            if moe:
                (entry.router, entry.E, entry.m, entry.norm_topk, entry.gate_up_t, entry.gate_up_stride, entry.down_t,
                 entry.down_stride, entry.I, entry.shared_gate_up_t, entry.shared_down_t, entry.Is,
                 entry.moe_fmt) = layer.mlp.block.args
            else:  # the MLP as swiglu_experts' only expert, as MLP.forward runs it
                gate_up, down = layer.mlp.kernel_weights
                entry.gate_up_t, entry.gate_up_stride, entry.down_t, entry.down_stride = (
                    gate_up.data_ptr(), gate_up.stride, down.data_ptr(), down.stride)
                entry.I, entry.moe_fmt, entry.E, entry.m, entry.dense = down.in_features, gate_up.format, 1, 1, 1
