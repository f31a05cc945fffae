"""Weights in the layout the fused kernels' matrix products read (kernels.py, `matmul_p`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64  # output columns per panel of a packed weight (the C source's PANEL)


@dataclass(frozen=True, repr=False)
class PackedWeight:
    """A weight as a model stores it, [..., C, Kd] (out features, in features; `...` e.g. experts), in
    the kernels' layout: transposed, in ceil(C / 64) panels of [Kd, 64] each contiguous, columns past C
    zero. `pack` makes one (a copy: pack after the weights are final); the tensor stays referenced
    while the kernels use its pointer."""

    tensor: torch.Tensor  # [..., ceil(C / 64), Kd, 64] float32, contiguous
    out_features: int  # C

    def __post_init__(self):
        # The kernels trust this layout with their pointers: refuse anything else here, once.
        t = self.tensor
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            raise ValueError("PackedWeight: the tensor must be contiguous float32 on the CPU")
        panels = -(-self.out_features // PANEL)
        if t.dim() < 3 or t.shape[-1] != PANEL or self.out_features < 1 or t.shape[-3] != panels:
            raise ValueError(f"PackedWeight: a tensor {tuple(t.shape)} does not hold {self.out_features} output "
                             f"columns in panels of {PANEL}")

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        if weight.dim() < 2 or weight.dtype != torch.float32 or not weight.is_cpu:
            raise ValueError(f"pack: need a float32 CPU weight [..., out, in], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        *lead, C, Kd = weight.shape
        panels = -(-C // PANEL)
        padded = weight.detach().new_zeros(*lead, panels * PANEL, Kd)
        padded[..., :C, :] = weight.detach()
        return cls(padded.view(*lead, panels, PANEL, Kd).transpose(-1, -2).contiguous(), C)

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[:-3])

    @property
    def in_features(self) -> int:
        return self.tensor.shape[-2]

    @property
    def stride(self) -> int:
        """Floats between consecutive matrices of the leading dims (0 for a single matrix)."""
        return self.tensor.stride(-4) if self.lead else 0

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def __repr__(self) -> str:
        return f"PackedWeight({[*self.lead, self.out_features, self.in_features]})"
