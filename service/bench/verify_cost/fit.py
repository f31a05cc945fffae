"""The cost model fitted on a measurement: seconds of a pass over the benched layers =
fixed + per_expert * U + per_position * w (+ per_expert_position * U * w when asked), by least squares,
with the prediction error on held-out (w, U) points.

Why this form: a memory-bound MoE pass reads each touched expert's weights once (per_expert * U) and
does w * k expert products plus per-position work (per_position * w), on top of what does not depend on
the window (router, shared expert weights, call overhead: fixed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

TERMS = ("fixed", "per_expert", "per_position")
CROSS = "per_expert_position"


@dataclass(frozen=True)
class CostModel:
    fixed: float
    per_expert: float
    per_position: float
    per_expert_position: float = 0.0

    def seconds(self, window: float, union: float) -> float:
        return (self.fixed + self.per_expert * union + self.per_position * window
                + self.per_expert_position * union * window)

    def to_json(self) -> dict:
        return asdict(self)


def _design(points: Sequence[tuple[int, float]], cross: bool) -> np.ndarray:
    w = np.array([p[0] for p in points], dtype=float)
    u = np.array([p[1] for p in points], dtype=float)
    columns = [np.ones_like(w), u, w] + ([u * w] if cross else [])
    return np.stack(columns, 1)


def fit_cost_model(points: Sequence[tuple[int, float]], seconds: Sequence[float], cross: bool = False) -> CostModel:
    """points: (w, U) per measurement; seconds: its median pass time."""
    need = 4 if cross else 3
    if len(points) != len(seconds) or len(points) < need:
        raise ValueError(f"a fit needs at least {need} (w, U) points with one time each, got {len(points)}")
    design = _design(points, cross)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError("the (w, U) points do not separate window from union: vary both")
    coef, *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=float), rcond=None)
    return CostModel(*(float(c) for c in coef))


@dataclass(frozen=True)
class HeldOut:
    points: tuple[tuple[int, int], ...]
    relative_errors: tuple[float, ...]  # (predicted - measured) / measured

    @property
    def max_abs(self) -> float:
        return max(abs(e) for e in self.relative_errors) if self.relative_errors else 0.0

    @property
    def median_abs(self) -> float:
        return float(np.median(np.abs(self.relative_errors))) if self.relative_errors else 0.0


def held_out_error(points: Sequence[tuple[int, int]], seconds: Sequence[float], every: int = 4,
                   cross: bool = False) -> HeldOut:
    """Fit on all but every `every`-th point (in the order given), predict those."""
    test = [i for i in range(len(points)) if i % every == every - 1]
    train = [i for i in range(len(points)) if i not in test]
    model = fit_cost_model([points[i] for i in train], [seconds[i] for i in train], cross)
    errors = tuple((model.seconds(*points[i]) - seconds[i]) / seconds[i] for i in test)
    return HeldOut(tuple(points[i] for i in test), errors)
