"""The MoE layers of a geometry in plain torch on any device (`--device cuda`; on the CPU the same code
is what the tests run): router logits, the window's routed experts as grouped products over its union,
the shared expert, in the weights' data type (bf16).

Grouped products: the window's (position, expert) pairs sorted by expert, the union's weights gathered
([U, 2I, H]), each expert's positions padded to the longest group, and two batched matmuls. A gather
copies the touched experts once, so its traffic follows U as the weights read do; a few launches per
layer whatever U is (a loop over experts would launch per expert and measure launch overhead)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.bench.verify_cost.geometry import Geometry


class TorchLayers:
    routes_itself = False  # the ids are given, not routed

    def __init__(self, g: Geometry, layers: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.n_layers = layers
        self.geometry, self.device, self.dtype = g, torch.device(device), dtype
        generator = torch.Generator(device=self.device).manual_seed(seed)
        E, H, I, Is = g.experts, g.hidden, g.expert_intermediate, g.shared_intermediate

        def draw(*shape: int) -> torch.Tensor:  # drawn where it lives (tens of GB drawn on a CPU take minutes)
            t = torch.empty(*shape, dtype=dtype, device=self.device)
            t.normal_(0.0, 0.02, generator=generator)
            return t

        self.layers = [dict(router=draw(E, H), gate_up=draw(E, 2 * I, H), down=draw(E, H, I),
                            shared_gate_up=draw(2 * Is, H) if Is else None, shared_down=draw(H, Is) if Is else None)
                       for _ in range(layers)]
        self.x: torch.Tensor | None = None
        self.plans: list[tuple] = []

    def prepare(self, ids: torch.Tensor, x: torch.Tensor | None = None) -> None:
        """ids [L, w, k]: the grouping of each layer's pairs, built outside the timed part (the engine
        sorts its pairs in the pass; that is small beside the products)."""
        L, w, k = ids.shape
        H = self.geometry.hidden
        if x is None:
            x = torch.randn(w, H, generator=torch.Generator().manual_seed(1))
        self.x = x.to(self.device, self.dtype)
        self.plans = [self._plan(layer_ids) for layer_ids in ids]

    def _plan(self, ids: torch.Tensor) -> tuple:
        w, k = ids.shape
        flat = ids.reshape(-1)
        experts, counts = torch.unique(flat, return_counts=True)  # the union, ascending
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        positions = order // k  # [pairs]
        group = torch.repeat_interleave(torch.arange(len(experts)), counts)  # [pairs] group of each sorted pair
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(flat)) - starts[group]  # [pairs] place within its group
        rows = int(counts.max())
        routing = torch.full((w, k), 1.0 / k)  # routing weights (their values do not change the time)
        weight = routing.reshape(-1)[order]
        to = self.device
        return (experts.to(to), positions.to(to), group.to(to), slot.to(to), rows, weight.to(to, self.dtype))

    def forward_layer(self, layer: dict, plan: tuple, x: torch.Tensor) -> torch.Tensor:
        experts, positions, group, slot, rows, weight = plan
        H = x.shape[1]
        _ = x @ layer["router"].T  # [w, E] the router's logits (routing itself is given)
        gate_up = layer["gate_up"].index_select(0, experts)  # [U, 2I, H]
        down = layer["down"].index_select(0, experts)  # [U, H, I]
        padded = x.new_zeros(len(experts), rows, H)  # [U, R, H]
        padded[group, slot] = x[positions]
        g, u = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [U, R, I] each
        y = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [U, R, H]
        out = x.new_zeros(x.shape).index_add_(0, positions, y[group, slot] * weight[:, None])  # [w, H]
        if layer["shared_gate_up"] is not None:
            sg, su = (x @ layer["shared_gate_up"].T).chunk(2, dim=-1)
            out = out + (F.silu(sg) * su) @ layer["shared_down"].T
        return out

    def run(self) -> list[torch.Tensor]:
        return [self.forward_layer(layer, plan, self.x) for layer, plan in zip(self.layers, self.plans, strict=True)]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.layers = []
