"""The contract of the MoE kernels (csrc/moe.c, compiled into library.py's library; it uses `dot`,
`exp512` and `matmul_p` from csrc/common.c and matmul.c) and `MoeBlock`, one layer's weights in its
layout.

Why: a decode step of the shipped MoE spends more time moving expert weights than computing with
them, and eager PyTorch moves them three times (index_select copies the touched experts, the matmul
reads the copy) in ~15 small ops per layer. This kernel reads each touched expert's weights once per
call, for every position that picked it, and does gate/up, SiLU * up, the routing weight and down in
one call; `moe_block` adds the router, softmax, top-k and the shared expert around it.

Contract of `swiglu_experts(x, gate_up, down, ids, weights, out, accumulate)` (`Kernels.swiglu_experts`):
- x [w, H]; gate_up: the experts' stacked gate and up projections [E, 2I, H] (gate rows, then up) and
  down [E, H, I], both as `PackedWeight`s; ids [w, n] int64 expert ids per position (distinct within a
  row), weights [w, n] float32 routing weights; out [w, H] float32.
- out[p] (+)= sum over the experts e picked by position p, in ascending e, of
  weights[p, j] * down[e] @ (silu(gate[e] @ x[p]) * (up[e] @ x[p])).
- Each position's result depends only on its own row: every element is a sum over k ascending of
  fused multiply-adds from zero, whatever else is in the window and wherever the position falls in a
  tile, so it is bitwise the same alone or in any pass (a verify pass and a plain decode step of the
  same token agree exactly).
- Experts are visited in ascending id, each read once per 16 positions that picked it (its weights
  stay in L2 across the chunks; cost follows the window's union).

`moe_block` splits a pass over a pool's threads by expert (up to 16 positions) or by position (longer
passes), bitwise the one-thread result either way (see the C comments).
"""

from __future__ import annotations

import torch

from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.packed import F32, PackedWeight, panel_format


class MoeBlock:
    """One Qwen2-MoE layer's weights, checked once, for `Kernels.moe_block` (a decode step calls it
    every layer, so the per-call work is only the window's own tensors)."""

    @property
    def bf16(self) -> bool:
        """Its panels hold bf16 (exact values, or for bf16 arithmetic)."""
        return self.format != F32

    def __init__(self, router_and_gate: torch.Tensor, top_k: int, norm_topk: bool, gate_up: torch.Tensor,
                 down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                 bf16: bool | None = None, math: str = "fp32", arena: PanelArena | None = None):
        """router_and_gate [E+1, H] (router rows, then the shared expert's gate row); gate_up [E, 2I, H];
        down [E, H, I]; shared_gate / shared_up [Is, H]; shared_down [H, Is]. Contiguous float32 CPU.
        math: the experts' arithmetic (`panel_format`; the router stays float32, so routing sees the
        same logits either way); bf16: force bf16 (True) or float32 (False) panels for math="fp32"; arena:
        where the packed weights and the router live (None: ordinary tensors)."""
        E, H = router_and_gate.shape[0] - 1, router_and_gate.shape[1]
        I, Is = gate_up.shape[1] // 2, shared_gate.shape[0]
        expected = {"router_and_gate": (E + 1, H), "gate_up": (E, 2 * I, H), "down": (E, H, I),
                    "shared_gate": (Is, H), "shared_up": (Is, H), "shared_down": (H, Is)}
        given = dict(router_and_gate=router_and_gate, gate_up=gate_up, down=down, shared_gate=shared_gate,
                     shared_up=shared_up, shared_down=shared_down)
        for name, t in given.items():
            if tuple(t.shape) != expected[name] or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"moe_block: {name} must be a contiguous float32 CPU tensor {expected[name]}")
        if not 1 <= top_k <= E:
            raise ValueError(f"moe_block: top_k must be in [1, {E}], got {top_k}")
        self.E, self.H, self.I, self.Is, self.top_k, self.norm_topk = E, H, I, Is, top_k, norm_topk
        # The kernel's layout (packed copies); these and the tensors given stay referenced while the
        # pointers below are in use.
        shared_gate_up = torch.cat([shared_gate, shared_up])
        # One format for all its packed weights (one kernel flag), see panel_format.
        parts = dict(gate_up=gate_up, down=down, shared_gate_up=shared_gate_up, shared_down=shared_down)
        self.format = panel_format(math, *parts.values(), bf16=bf16)
        packed = {name: PackedWeight.pack(w, self.format, arena) for name, w in parts.items()}
        router = router_and_gate if arena is None else arena.copy_of(router_and_gate)
        self.tensors = dict(given, **packed, router=router)
        self.args = (router.data_ptr(), E, top_k, int(norm_topk), packed["gate_up"].data_ptr(),
                     packed["gate_up"].stride, packed["down"].data_ptr(), packed["down"].stride, I,
                     packed["shared_gate_up"].data_ptr(), packed["shared_down"].data_ptr(), Is, self.format)
