"""Weights in the layout the fused kernels' matrix products read (kernels.py, `matmul_p`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64  # output columns per panel of a packed weight (the C source's PANEL)


@dataclass(frozen=True, repr=False)
class PackedWeight:
    """A weight as a model stores it, [..., C, Kd] (out features, in features; `...` e.g. experts), in
    the kernels' layout: transposed, in ceil(C / 64) panels of [Kd, 64] each contiguous, columns past C
    zero; float32, or bfloat16 when every value is a bf16 value (the kernels widen it back exactly, so
    the results are bitwise the same for half the bytes). `pack` makes one (a copy: pack after the
    weights are final); the tensor stays referenced while the kernels use its pointer."""

    tensor: torch.Tensor  # [..., ceil(C / 64), Kd, 64] float32 or bfloat16, contiguous
    out_features: int  # C

    def __post_init__(self):
        # The kernels trust this layout with their pointers: refuse anything else here, once.
        t = self.tensor
        if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_cpu or not t.is_contiguous():
            raise ValueError("PackedWeight: the tensor must be contiguous float32 or bfloat16 on the CPU")
        panels = -(-self.out_features // PANEL)
        if t.dim() < 3 or t.shape[-1] != PANEL or self.out_features < 1 or t.shape[-3] != panels:
            raise ValueError(f"PackedWeight: a tensor {tuple(t.shape)} does not hold {self.out_features} output "
                             f"columns in panels of {PANEL}")

    @classmethod
    def pack(cls, weight: torch.Tensor, bf16: bool | None = None) -> PackedWeight:
        """bf16: store bfloat16 (refused unless every value is one), float32 (False), or whichever is
        exact (None: bfloat16 when `holds_bf16`)."""
        if weight.dim() < 2 or weight.dtype != torch.float32 or not weight.is_cpu:
            raise ValueError(f"pack: need a float32 CPU weight [..., out, in], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if bf16 is None:
            bf16 = holds_bf16(weight)
        elif bf16 and not holds_bf16(weight):
            raise ValueError("pack: the weight holds values bfloat16 cannot represent; store it as float32")
        *lead, C, Kd = weight.shape
        panels = -(-C // PANEL)
        padded = weight.detach().new_zeros(*lead, panels * PANEL, Kd, dtype=torch.bfloat16 if bf16 else torch.float32)
        padded[..., :C, :] = weight.detach()
        return cls(padded.view(*lead, panels, PANEL, Kd).transpose(-1, -2).contiguous(), C)

    @property
    def bf16(self) -> bool:
        return self.tensor.dtype == torch.bfloat16

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


def holds_bf16(*weights: torch.Tensor) -> bool:
    """Every value of every weight is a bfloat16 value (float32 -> bfloat16 -> float32 gives it back)."""
    return all(torch.equal(w.detach().to(torch.bfloat16).float(), w.detach()) for w in weights)
