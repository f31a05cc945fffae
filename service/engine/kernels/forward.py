"""A short pass from token ids to logits in one C call (`Kernels.forward_logits`): the embedding rows,
every decoder layer (decoder.py), the final norm and the output layer of the rows asked for, and each
logit row's first maximum.

Why: at the shipped model's size a decode step streams ~8.7 MB of weights through the caches, which
evicts the interpreter's own working set, so every Python call between two kernel calls then runs from
the last-level cache: measured on a 2-core Intel Xeon, the final norm as a module call took ~60 us after
the layer loop (~6 us warm), the embedding and the output layer's wrapper ~40 us each. One call for the
whole pass leaves one wrapper per step. The same C functions run on the same values in the same order
(the embedding is a row copy, rms_norm per row, `linear` over the rows' panels), so every figure is
bitwise the separate calls' (tests/engine/kernels/test_forward_kernel.py).

`OutputHead` holds the model's constant arguments around the layers, checked once when the model is
fused (it keeps pointers into the embedding table, the final norm and the packed output layer: they
must not move or be replaced afterwards).
"""

from __future__ import annotations

import ctypes

import torch

from service.engine.kernels.packed import PackedWeight


class OutputHead(ctypes.Structure):
    """forward.c's struct output_head, field for field."""

    _fields_ = [("embed", ctypes.c_void_p), ("norm_w", ctypes.c_void_p), ("lm_wt", ctypes.c_void_p),
                ("V", ctypes.c_int64), ("eps", ctypes.c_float), ("lm_fmt", ctypes.c_int)]

    @classmethod
    def of(cls, embed: torch.Tensor, norm_weight: torch.Tensor, eps: float, lm_head: PackedWeight) -> OutputHead:
        """embed [V, H] and norm_weight [H] contiguous float32 CPU; lm_head the packed [V, H] output layer
        (the struct keeps them alive: the kernel reads them through its pointers)."""
        V, H = embed.shape
        for name, t, shape in (("embed", embed, (V, H)), ("norm_weight", norm_weight, (H,))):
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"forward_logits: {name} must be a contiguous float32 CPU tensor {shape}")
        if lm_head.lead or (lm_head.out_features, lm_head.in_features) != (V, H):
            raise ValueError(f"forward_logits: the output layer must be one packed [{V}, {H}] matrix, got {lm_head}")
        head = cls(embed.data_ptr(), norm_weight.data_ptr(), lm_head.data_ptr(), V, float(eps), lm_head.format)
        head.H, head.tensors = H, (embed, norm_weight, lm_head)
        return head


class StepSampling(ctypes.Structure):
    """forward.c's struct step_sampling, field for field: how each row of `Kernels.decode_steps` picks
    its token (a temperature of 0: the argmax; above 0: `sample_row`'s draw under its top-k and top-p
    with that step's uniform)."""

    _fields_ = [("temperature", ctypes.c_void_p), ("top_k", ctypes.c_void_p), ("top_p", ctypes.c_void_p),
                ("uniforms", ctypes.c_void_p)]

    @classmethod
    def of(cls, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           uniforms: torch.Tensor) -> StepSampling:
        """temperature [B] float32, top_k [B] int64, top_p [B] float32, uniforms [K, B] float32, all
        contiguous CPU (the struct keeps them alive)."""
        B = temperature.shape[0]
        for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                               ("top_p", top_p, torch.float32), ("uniforms", uniforms, torch.float32)):
            if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu or t.shape[-1] != B:
                raise ValueError(f"decode_steps: {name} must be a contiguous {dtype} CPU tensor [..., {B}]")
        sampling = cls(temperature.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), uniforms.data_ptr())
        sampling.B, sampling.K, sampling.tensors = B, uniforms.shape[0], (temperature, top_k, top_p, uniforms)
        return sampling
