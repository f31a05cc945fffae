"""The MoE layers of a geometry on the embedded engine's fused CPU kernel (`Kernels.moe_block`, the call
a decode step makes every layer: router, softmax, top-k, routed experts, shared expert), with random
weights in the engine's own panel format, and routing steered so a window's ids are exactly the ones
asked for.

How the routing is steered without touching the kernel: position p's input is the unit vector e_p
(H >= w), and the layer's router row e holds 1 at column p when position p should pick expert e, else
0. Position p's logits are then 1 for its k experts and 0 elsewhere, so the kernel's own top-k picks
exactly them (and returns them: the run checks it). Writing the router rows happens before a point is
timed; it leaves the router (E x H float32, small beside the experts) in cache, a slight favour.

Weights are drawn directly in the packed layout (`PackedWeight`): which value sits where does not
change the time, and packing float32 copies would need twice the memory. A geometry without a shared
expert gets a 1-wide one (3H weights: nothing beside the routed experts) because the kernel always
runs one."""

from __future__ import annotations

import torch

from service.bench.verify_cost.geometry import Geometry
from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.library import Kernels
from service.engine.kernels.packed import (
    AMX_INPUT_MULTIPLE,
    BF16,
    BF16_AMX,
    BF16_MATH,
    PAIRED,
    PANEL,
    PackedWeight,
    amx_takes,
)

WINDOW_MAX = 16  # unit-vector routing needs H >= w; the benchmark stops at 16 positions


def panel_format_for(math: str, g: Geometry) -> int:
    """The engine's panels for its math, as `panel_format` picks them for a layer: bf16 pairs for bf16
    arithmetic, and for AMX arithmetic where every input size of the block is a multiple of 32 (else bf16
    arithmetic), else bf16 values widened."""
    if math == "amx":  # (a geometry without a shared expert runs one of 32: see SteeredBlock)
        takes = amx_takes(g.hidden, g.expert_intermediate, g.shared_intermediate or AMX_INPUT_MULTIPLE)
        return BF16_AMX if takes else BF16_MATH
    return BF16_MATH if math == "bf16" else BF16


def random_packed(lead: tuple[int, ...], out_features: int, in_features: int, fmt: int,
                  generator: torch.Generator, arena: PanelArena, quiet_rows: int = 0) -> PackedWeight:
    """Random values in the packed layout, in the arena's huge pages as the engine keeps its weights;
    output rows < quiet_rows zero (see whole_pass.py)."""
    panels = -(-out_features // PANEL)
    tail = (panels, -(-in_features // 2), PANEL, 2) if fmt in PAIRED else (panels, in_features, PANEL)
    t = arena.empty((*lead, *tail), torch.bfloat16)
    t.normal_(0.0, 0.02, generator=generator)
    if quiet_rows:  # output row r is column r of the first panel (quiet_rows <= PANEL)
        first_panel = t[..., 0, :, :quiet_rows, :] if fmt in PAIRED else t[..., 0, :, :quiet_rows]
        first_panel.zero_()
    return PackedWeight(t, out_features, in_features, fmt)


class SteeredBlock:
    """One layer for `Kernels.moe_block`: what `MoeBlock` holds (E, H, top_k, args), built from packed
    random weights and a router this class rewrites per window. quiet_rows: the output rows of the down
    projections left zero (the steering columns of a whole pass, whole_pass.py)."""

    def __init__(self, g: Geometry, fmt: int, generator: torch.Generator, arena: PanelArena, quiet_rows: int = 0):
        self.E, self.H, self.top_k, self.norm_topk = g.experts, g.hidden, g.top_k, False
        # The kernel always runs a shared expert: where the geometry has none, one of width 1 (32 for the
        # AMX tiles, which take inputs in blocks of 32), next to nothing beside the routed experts.
        self.I, self.Is = g.expert_intermediate, g.shared_intermediate or (AMX_INPUT_MULTIPLE if fmt == BF16_AMX else 1)
        self.router = arena.empty((g.experts + 1, g.hidden), torch.float32).zero_()  # [E+1, H] (row E: shared gate)
        self.gate_up = random_packed((g.experts,), 2 * self.I, g.hidden, fmt, generator, arena)
        self.down = random_packed((g.experts,), g.hidden, self.I, fmt, generator, arena, quiet_rows)
        self.shared_gate_up = random_packed((), 2 * self.Is, g.hidden, fmt, generator, arena)
        self.shared_down = random_packed((), g.hidden, self.Is, fmt, generator, arena, quiet_rows)
        self.format = fmt
        # The argument order of MoeBlock.args (the C moe_block's), so the same wrapper call runs it.
        self.args = (self.router.data_ptr(), self.E, self.top_k, 0, self.gate_up.data_ptr(), self.gate_up.stride,
                     self.down.data_ptr(), self.down.stride, self.I, self.shared_gate_up.data_ptr(),
                     self.shared_down.data_ptr(), self.Is, fmt)

    def steer(self, ids: torch.Tensor) -> None:
        """ids [w, k]: position p picks ids[p] (with inputs e_p)."""
        w, k = ids.shape
        self.router.zero_()
        self.router[ids.reshape(-1), torch.arange(w).repeat_interleave(k)] = 1.0


class FusedCpuLayers:
    """`layers` steered blocks; `run(ids)` is one pass of a window through all of them."""

    device = "cpu"
    routes_itself = True  # the kernel routes: its ids are checked against the window

    def __init__(self, kernels: Kernels, g: Geometry, layers: int, math: str, threads: int = 1, seed: int = 0):
        if g.hidden < WINDOW_MAX:
            raise ValueError(f"geometry {g.name!r}: hidden size {g.hidden} < {WINDOW_MAX} positions")
        generator = torch.Generator().manual_seed(seed)
        self.kernels, self.geometry, self.math = kernels, g, math
        self.n_layers = layers
        arena = PanelArena()
        self.blocks = [SteeredBlock(g, panel_format_for(math, g), generator, arena) for _ in range(layers)]
        self.pool = kernels.pool(threads) if threads > 1 else None
        self.inputs = torch.eye(WINDOW_MAX, g.hidden)  # [16, H] unit vectors e_p
        self.window_ids: torch.Tensor | None = None

    def prepare(self, ids: torch.Tensor) -> None:
        """ids [L, w, k]: steer every layer's router (outside the timed part)."""
        for block, layer_ids in zip(self.blocks, ids, strict=True):
            block.steer(layer_ids)
        self.window_ids = ids

    def run(self) -> list[torch.Tensor]:
        """One pass of the prepared window through every layer -> each layer's routed ids [w, k]."""
        w = self.window_ids.shape[1]
        x = self.inputs[:w]
        return [self.kernels.moe_block(block, x, self.pool)[2] for block in self.blocks]

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
