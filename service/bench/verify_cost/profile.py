"""The verify-cost profile file (`moespec bench verify-cost` writes it, `moespec whatif --cost-profile`
reads it): device, geometry, data type, the measured cost per window size and union, and the fitted
model. Format in docs/contracts.md. Reading it needs neither torch nor the kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.bench.verify_cost.fit import CostModel
from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.json_file import read_json_object

FORMAT = "moespec.verify-cost/1"
MOE_BLOCKS, WHOLE_PASS = "moe-blocks", "whole-pass"


class ProfileError(ValueError):
    """A file that is not a readable verify-cost profile; the message names the problem."""


@dataclass(frozen=True)
class CostProfile:
    geometry: Geometry
    layers_benched: int
    model: CostModel  # seconds of a pass over `layers_benched` layers
    device: str
    plain_step_seconds: float  # measured (w = 1, U = k) over the benched layers
    scope: str = MOE_BLOCKS  # what a pass timed: the MoE blocks alone, or the engine's whole verify pass
    context: int = 0  # the whole pass's cached positions (0 for the MoE blocks)

    def describe_scope(self) -> str:
        return "MoE blocks only" if self.scope == MOE_BLOCKS else f"the whole pass at context {self.context}"

    def pass_seconds(self, window: float, union: float, layers: int | None = None) -> float:
        """A pass of `window` positions touching `union` experts per layer (mean over layers), over
        `layers` MoE layers (default: the geometry's), scaled from the benched layers."""
        layers = self.geometry.layers if layers is None else layers
        return max(0.0, self.model.seconds(window, union)) * layers / self.layers_benched


def load_profile(path: Path) -> CostProfile:
    data = read_json_object(path, "cost profile", ProfileError)
    if data.get("format") != FORMAT:
        raise ProfileError(f"{path}: not a verify-cost profile (format {FORMAT!r} expected)")
    try:
        scope = str(data.get("scope", MOE_BLOCKS))
        if scope not in (MOE_BLOCKS, WHOLE_PASS):
            raise ValueError(f"scope {scope!r}")
        return CostProfile(Geometry.from_json(data["geometry"]), int(data["layers_benched"]),
                           CostModel(**data["model"]), str(data["device"]), float(data["plain_step_seconds"]),
                           scope, int(data.get("context", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: a malformed cost profile ({e!r})") from None
