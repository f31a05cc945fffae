"""Pricing a replay's verify passes with a verify-cost profile (`moespec whatif --cost-profile FILE`)
instead of the recording's own timings: what the recorded routing would cost on the profile's machine
and geometry.

A replayed window of w positions whose recorded per-layer unions average U costs the profile's fitted
pass, `CostProfile.pass_seconds(w, U')`, over the profile geometry's MoE layers. Approximations:
- A profile of the MoE blocks alone (router, routed and shared experts; `--context 0`) leaves out
  attention, the embedding, the output layer and the step's bookkeeping: the predicted verify time is
  the MoE part of a pass on that machine. A whole-pass profile (`--context C`) prices the embedded
  engine's whole verify pass with C positions cached, whatever context the recorded pass had.
- Per-layer unions enter through their mean: exact under the fitted model, which is linear in U.
- Another geometry (other E or k than the recording's): each window's union is carried over as its
  share of its top-k, U' = U * k' / k, clipped to [k', min(E', w k')]; routing of the other model is
  not known, only that overlap.
- Layers: the recorded mean union stands for every layer of the profile's geometry.
- Draft time stays the recording's own (the profile measures the target's verify pass only).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.bench.verify_cost.profile import CostProfile


@dataclass(frozen=True)
class ProfilePricing:
    profile: CostProfile
    recorded_top_k: int
    recorded_experts: int

    @property
    def same_geometry(self) -> bool:
        g = self.profile.geometry
        return (g.top_k, g.experts) == (self.recorded_top_k, self.recorded_experts)

    def union(self, window: int, recorded_union: float) -> float:
        if self.same_geometry:
            return recorded_union
        g = self.profile.geometry
        scaled = recorded_union * g.top_k / self.recorded_top_k
        return min(max(scaled, g.top_k), min(g.experts, window * g.top_k))

    def seconds(self, window: int, recorded_union: float) -> float:
        return self.profile.pass_seconds(window, self.union(window, recorded_union))

    def describe(self) -> str:
        g = self.profile.geometry
        mapped = "" if self.same_geometry else (f"; unions carried over from k={self.recorded_top_k} of "
                                                f"{self.recorded_experts} as a share of top-k")
        return (f"{g.name} (E={g.experts}, k={g.top_k}, {g.layers} MoE layers) on {self.profile.device}, "
                f"benched over {self.profile.layers_benched} layers, {self.profile.describe_scope()}{mapped}")
