"""Weights in the layout the fused kernels' matrix products read (csrc/matmul.c, `matmul_p`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.kernels.hugepages import PanelArena

PANEL = 64  # output columns per panel of a packed weight (the C source's PANEL)
# Panel formats (the C source's PANELS_*): float32 weights; bf16 weights widened exactly (float32
# arithmetic); bf16 weight pairs read by bf16 arithmetic (math="bf16": each matrix product rounds its
# input to bf16 and accumulates in float32, twice the products per instruction on AVX512-BF16).
F32, BF16, BF16_MATH = 0, 1, 2
# Format 2's layout for the AMX tile unit (csrc/amx.c, math="amx": Intel Xeons with AMX): inputs rounded to
# bf16 as for format 2, the tile unit's own float32 sums. Needs an input size that is a multiple of 32.
BF16_AMX = 3
PAIRED = (BF16_MATH, BF16_AMX)  # the formats whose panels hold bf16 pairs
MATHS = ("fp32", "bf16", "amx")  # what a model's matrix products compute in (`panel_format`)
AMX_INPUT_MULTIPLE = 32  # one tile's depth: 16 pairs


@dataclass(frozen=True, repr=False)
class PackedWeight:
    """A weight as a model stores it, [..., C, Kd] (out features, in features; `...` e.g. experts), in
    the kernels' layout: transposed, in ceil(C / 64) panels, each contiguous, columns past C zero. The
    panels hold (`format`) float32 [Kd, 64]; or bfloat16 [Kd, 64] when every value is a bf16 value (the
    kernels widen it back exactly, so the results are bitwise the same for half the bytes); or, for bf16
    arithmetic, bfloat16 pairs [ceil(Kd / 2), 64, 2] (each column's weights for k and k + 1 side by side,
    a zero after an odd Kd: the operand layout of VDPBF16PS). `pack` makes one (a copy: pack after the
    weights are final); the tensor stays referenced while the kernels use its pointer."""

    tensor: torch.Tensor  # [..., P, Kd, 64] float32 or bfloat16, or [..., P, ceil(Kd / 2), 64, 2] bfloat16
    out_features: int  # C
    in_features: int  # Kd
    format: int | None = None  # None: F32 or BF16 by the tensor's dtype

    def __post_init__(self):
        # The kernels trust this layout with their pointers: refuse anything else here, once.
        if self.format is None:
            object.__setattr__(self, "format", F32 if self.tensor.dtype == torch.float32 else BF16)
        t, fmt = self.tensor, self.format
        dtype = torch.float32 if fmt == F32 else torch.bfloat16
        if fmt not in (F32, BF16, *PAIRED) or t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"PackedWeight: format {fmt} needs a contiguous {dtype} CPU tensor")
        if fmt == BF16_AMX and not amx_takes(self.in_features):
            raise ValueError(f"PackedWeight: AMX panels need an input size that is a multiple of "
                             f"{AMX_INPUT_MULTIPLE}, got {self.in_features}")
        panels = -(-self.out_features // PANEL)
        paired = fmt in PAIRED
        tail = (panels, -(-self.in_features // 2), PANEL, 2) if paired else (panels, self.in_features, PANEL)
        if t.dim() < len(tail) or tuple(t.shape[-len(tail):]) != tail or self.out_features < 1 or self.in_features < 1:
            raise ValueError(f"PackedWeight: a tensor {tuple(t.shape)} does not hold a [{self.out_features}, "
                             f"{self.in_features}] weight in format {fmt}")

    @classmethod
    def pack(cls, weight: torch.Tensor, fmt: int | None = None, arena: PanelArena | None = None) -> PackedWeight:
        """fmt: F32, BF16 (refused unless every value is a bf16 value), BF16_MATH or BF16_AMX (the weight
        rounded to bf16: bf16 arithmetic is lossy by choice; BF16_AMX needs an input size that is a
        multiple of AMX_INPUT_MULTIPLE), or None: BF16 when `holds_bf16`, else F32. arena:
        where the panels live (hugepages.py; None: an ordinary tensor)."""
        if weight.dim() < 2 or weight.dtype != torch.float32 or not weight.is_cpu:
            raise ValueError(f"pack: need a float32 CPU weight [..., out, in], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if fmt is None:
            fmt = BF16 if holds_bf16(weight) else F32
        elif fmt == BF16 and not holds_bf16(weight):
            raise ValueError("pack: the weight holds values bfloat16 cannot represent; store it as float32")
        fmt = int(fmt)
        *lead, C, Kd = weight.shape
        panels = -(-C // PANEL)
        Kp = Kd + Kd % 2 if fmt in PAIRED else Kd
        dtype = torch.float32 if fmt == F32 else torch.bfloat16
        padded = weight.detach().new_zeros(*lead, panels * PANEL, Kp, dtype=dtype)
        padded[..., :C, :Kd] = weight.detach()
        panel_major = padded.view(*lead, panels, PANEL, Kp).transpose(-1, -2)  # [..., P, Kp, 64]
        if fmt in PAIRED:  # [..., P, Kp / 2, 2, 64] -> [..., P, Kp / 2, 64, 2]
            panel_major = panel_major.reshape(*lead, panels, Kp // 2, 2, PANEL).transpose(-1, -2)
        return cls(panel_major.contiguous() if arena is None else arena.copy_of(panel_major), C, Kd, fmt)

    @property
    def bf16(self) -> bool:
        return self.tensor.dtype == torch.bfloat16

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[:-4 if self.format in PAIRED else -3])

    @property
    def stride(self) -> int:
        """Weights between consecutive matrices of the leading dims (0 for a single matrix)."""
        lead = self.lead
        return self.tensor.stride(len(lead) - 1) if lead else 0

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def __repr__(self) -> str:
        return f"PackedWeight({[*self.lead, self.out_features, self.in_features]}, format {self.format})"


def amx_takes(*in_features: int) -> bool:
    """The AMX tiles can read weights of these input sizes (whole blocks of AMX_INPUT_MULTIPLE)."""
    return all(k % AMX_INPUT_MULTIPLE == 0 for k in in_features)


def panel_format(math: str, *weights: torch.Tensor, bf16: bool | None = None) -> int:
    """The one format for weights a kernel call reads together: AMX arithmetic if asked (math="amx") and
    every weight's input size is a multiple of AMX_INPUT_MULTIPLE (else bf16 arithmetic, format 2's
    layout and rounding), bf16 arithmetic if asked (math="bf16"), else bf16 panels where every value is
    a bf16 value (or as `bf16` forces: True, refused by `pack` unless exact, or False), else float32."""
    if math not in MATHS:
        raise ValueError(f"math must be one of {MATHS}, got {math!r}")
    if math == "amx":
        return BF16_AMX if amx_takes(*(w.shape[-1] for w in weights)) else BF16_MATH
    if math == "bf16":
        return BF16_MATH
    if bf16 is not None:
        return BF16 if bf16 else F32
    return BF16 if holds_bf16(*weights) else F32


def holds_bf16(*weights: torch.Tensor) -> bool:
    """Every value of every weight is a bfloat16 value (float32 -> bfloat16 -> float32 gives it back)."""
    return all(torch.equal(w.detach().to(torch.bfloat16).float(), w.detach()) for w in weights)
