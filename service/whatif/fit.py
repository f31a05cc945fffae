"""The what-if cost model, fitted on one recorded run: what a verify pass and a draft cost there.

The replay prices steps the recorded run never took, so every price comes from what that run
measured, in the forms below (`service.whatif.predict` picks between them per replayed step):
- `fit_cost_curve`: least squares seconds ~ c0 + c1 * window + c2 * mean union per layer, with the
  run's plain decode step (window 1, union m) as a fixed point so short windows are interpolated,
  not extrapolated; window and union move together, so a fit with a negative slope gives way to the
  better one-feature fit.
- `fit_speculative_curve`: windows of 2+ positions get their own free-intercept line when the run
  has enough of them off the common size (a pass after a draft pays a fixed part a plain step does
  not).
- `fit_window_seconds`: where the run itself has at least MIN_WINDOW_STEPS passes of a window size
  (the n-gram drafter proposes 0..k tokens, so its runs have every size), their mean verify seconds
  is used instead: the real cost is concave in the union, so a line through the plain step and the
  wide windows runs low in between.
- `fit_draft_curve`: draft seconds per step = a fixed part + a part per draft, fitted on the steps
  that drafted (the last steps of a request draft fewer; the first draft pass after a verify is the
  dearer one, its weights having left the cache); the n-gram drafter pays one lookup per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.types import Drafter, StepRecord

MIN_WINDOW_STEPS = 10  # recorded passes of one window size that make its own mean the prediction
MIN_OFF_SIZE_STEPS = 5  # recorded multi-position passes off the common size that identify their own line


@dataclass(frozen=True)
class CostCurve:
    """verify seconds = intercept + per_position * window + per_expert * mean union per layer."""

    intercept: float
    per_position: float
    per_expert: float
    plain_step_seconds: float  # the anchor: the run's median plain decode step
    steps: int  # recorded steps it was fitted on

    def seconds(self, window: float, union: float) -> float:
        return max(0.0, self.intercept + self.per_position * window + self.per_expert * union)


@dataclass(frozen=True)
class DraftCurve:
    """draft seconds of a step that drafted d > 0 tokens = per_step + per_draft * d."""

    per_step: float
    per_draft: float

    def seconds(self, drafted: int) -> float:
        return self.per_step + self.per_draft * drafted


def fit_cost_curve(steps: Sequence[StepRecord], top_k: int, anchored: bool = True) -> CostCurve:
    """Least squares of verify seconds on window size and mean union per layer, through the run's
    plain decode step (window 1, union m): the engine measures that step all the time (it is the
    unit of decode_step_equivalents), so short windows are interpolated between it and the recorded
    ones rather than extrapolated from the recorded ones alone. Without it (or `anchored=False`), a
    free intercept."""
    plain_steps = [s.verify_seconds / s.decode_step_equivalents for s in steps
                   if anchored and s.decode_step_equivalents > 0]
    plain = statistics.median(plain_steps) if plain_steps else 0.0
    windows = np.array([s.window for s in steps], dtype=float)
    unions = np.array([float(np.mean(s.unique_experts)) for s in steps])
    seconds = np.array([s.verify_seconds for s in steps])
    if plain_steps:  # through the anchor: fit the excess over a plain step
        target, features = seconds - plain, {1: windows - 1, 2: unions - top_k}
    else:
        target, features = seconds, {0: np.ones_like(windows), 1: windows, 2: unions}
    # A slope is identifiable if its feature varies, or (through the anchor) is ever non-zero.
    slopes = [i for i in (1, 2) if np.ptp(features[i]) > 0 or (plain_steps and np.any(features[i] != 0))]
    base = [0] if 0 in features else []
    # Window and union move together, so the joint fit can trade one against the other into a
    # negative slope that extrapolates badly; then the better one-feature fit is kept.
    candidates = [base + slopes] + ([base + [i] for i in slopes] if len(slopes) == 2 else [])
    best: tuple[float, list[int], np.ndarray] | None = None
    for keep in candidates:
        if not keep:
            continue
        design = np.stack([features[i] for i in keep], 1)
        coef, *_ = np.linalg.lstsq(design, target, rcond=None)
        if any(c < 0 for i, c in zip(keep, coef, strict=True) if i):
            continue
        residual = float(np.sum((design @ coef - target) ** 2))
        if keep is candidates[0]:  # the joint fit is sensible: use it
            best = (residual, keep, coef)
            break
        if best is None or residual < best[0]:
            best = (residual, keep, coef)
    c = [0.0, 0.0, 0.0]
    if best is not None:
        for i, value in zip(best[1], best[2], strict=True):
            c[i] = float(value)
    if plain_steps:  # seconds = plain + c1 (w - 1) + c2 (u - m), written as intercept + slopes
        c[0] = plain - c[1] - c[2] * top_k
    elif best is None:  # nothing fits with a positive slope: a flat cost
        c[0] = float(np.mean(seconds))
    return CostCurve(c[0], c[1], c[2], plain, len(steps))


def fit_speculative_curve(steps: Sequence[StepRecord], top_k: int) -> CostCurve | None:
    """A free-intercept line on the run's own multi-position passes (window >= 2), when at least
    MIN_OFF_SIZE_STEPS of them have another size than the most common one (a model-drafter run has
    them where requests end and the token budget cuts the draft short) and the line has a positive
    slope and a non-negative fixed part; else None.

    Why not through the plain step: a pass after a draft is not a plain step plus its extra
    positions. It pays a fixed part a plain step does not (the draft model's passes have evicted
    the target's weights from the caches; the ragged multi-position path), so the line through the
    plain step and the wide windows runs low at short windows.
    """
    spec = [s for s in steps if s.window >= 2]
    if not spec:
        return None
    sizes = [s.window for s in spec]
    common = max(set(sizes), key=sizes.count)
    if sum(w != common for w in sizes) < MIN_OFF_SIZE_STEPS:
        return None
    curve = fit_cost_curve(spec, top_k, anchored=False)
    # A pass has no negative fixed part: a negative intercept is the noise of a few off-size passes
    # extrapolated, and the line through the plain step is the safer guess then.
    sloped = curve.per_position > 0 or curve.per_expert > 0
    return curve if sloped and curve.intercept >= 0 else None


def fit_draft_curve(steps: Sequence[StepRecord]) -> DraftCurve:
    """n-gram drafter: one lookup per step whatever it proposes (a suffix search over the history,
    no model pass), so the mean seconds of the run's lookups per step and nothing per draft (a fit
    proportional to the drafts would price a k'=1 lookup at an eighth of a k=8 one). Model drafter:
    least squares of draft seconds on drafts per step when that varies and both parts come out
    non-negative; otherwise draft time proportional to the drafts."""
    if steps and steps[0].drafter is Drafter.NGRAM:
        lookups = [s.draft_seconds for s in steps if s.drafted > 0 or s.draft_seconds > 0]
        return DraftCurve(statistics.fmean(lookups) if lookups else 0.0, 0.0)
    drafting = [s for s in steps if s.drafted > 0]
    if not drafting:
        return DraftCurve(0.0, 0.0)
    drafted = np.array([s.drafted for s in drafting], dtype=float)
    seconds = np.array([s.draft_seconds for s in drafting])
    if np.ptp(drafted) > 0:
        (per_step, per_draft), *_ = np.linalg.lstsq(np.stack([np.ones_like(drafted), drafted], 1), seconds,
                                                    rcond=None)
        if per_step >= 0 and per_draft >= 0:
            return DraftCurve(float(per_step), float(per_draft))
    return DraftCurve(0.0, float(seconds.sum() / drafted.sum()))


def fit_window_seconds(steps: Sequence[StepRecord]) -> dict[int, float]:
    """Window size -> mean verify seconds of the run's passes of that size, for the sizes it has at
    least MIN_WINDOW_STEPS of: there the run's own mean prices a pass, not a line."""
    by_window: dict[int, list[float]] = {}
    for s in steps:
        by_window.setdefault(s.window, []).append(s.verify_seconds)
    return {w: statistics.fmean(v) for w, v in sorted(by_window.items()) if len(v) >= MIN_WINDOW_STEPS}
