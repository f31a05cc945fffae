"""What-if replay: from one recorded run at draft length k, predict the cost of every k' <= k.

Contract (`predict(steps, ...)`, pure; steps of one policy, grouped by request, in order):
- Each recorded step is truncated to k': it would have drafted min(d, k') of its d drafts (the
  first k' drafts of a deterministic drafter, and the first k' of a sampled one are distributed
  the same), accepted min(a, k'), and verified a window of min(d, k') + 1 positions whose per-layer
  union is recounted from the first positions of the recorded top-k ids [L, w, m].
- Verify seconds come from a cost curve fitted on the same run, least squares
  seconds ~ c0 + c1 * window + c2 * mean union per layer, with the run's plain decode step
  (window 1, union m) as a fixed point so short windows are interpolated, not extrapolated; window
  and union move together, so a fit with a negative slope gives way to the better one-feature fit.
  Windows of 2+ positions get their own free-intercept line when the run has enough of them off
  the common size (`fit_speculative_curve`: a pass after a draft pays a fixed part a plain step
  does not). Where the run itself has at least MIN_WINDOW_STEPS passes of a window size (the n-gram drafter
  proposes 0..k tokens, so its runs have every size), their mean verify seconds is used instead:
  the real cost is concave in the union, so a line through the plain step and the wide windows
  runs low in between.
  Draft seconds per step = a fixed part + a part per draft, fitted on the steps that drafted (the
  last steps of a request draft fewer; the first draft pass after a verify is the dearer one, its
  weights having left the cache); k' = 0: none.
- Committed tokens per step, two ways. `truncated`: the mean of min(a, k') + 1 over the recorded
  steps, which treats steps as independent. It is biased low for k' < k: a k'-run cuts a long
  accepted run short and starts its next step inside it, where acceptance is high. `replay`
  (the estimate used) walks each request's token positions with the acceptance outcome the run
  observed there (1 accepted, 0 rejected / nothing to propose) and replays windows of k' drafts
  over them; the one position a fully accepted step never tested (its bonus token) is drawn with the
  run's own P(accept | previous accepted). It keeps the correlation between neighbouring steps;
  what it cannot know is how the drafter would behave at a step start the run never had (the
  n-gram drafter's lookup, the draft model's catch-up), so it is exact only for position-wise
  deterministic drafters (model drafter at temperature 0 with greedy requests).
- Seconds per committed token (`replay`) = the replayed steps' own seconds / the tokens they commit.
  The replay walks the steps a k'-run would take, so their mix is the k'-run's, not the recorded
  run's: a k'-run splits one long accepted step of the k-run into several full k'-windows, so it has
  more drafting steps (and, for the n-gram drafter, fewer steps with nothing to propose) than the
  recorded steps truncated to k'. Pricing the truncated recorded steps (the `truncated` estimate)
  is therefore biased low for k' < k in time as well as in tokens. A replayed step starting at
  output position p drafts min(k', offer(p)) tokens: at a recorded step start the recorded count;
  inside a recorded step's accepted run, for the model drafter k, for the n-gram drafter the
  recorded count (the lookup keeps matching the same earlier span, which offers as many tokens as
  before), never past the request's token budget (its last token is always a plain step). Its window
  is priced like a recorded one (window size mean, else the cost curve), with the union recounted
  from the recorded window that holds the same positions (the same tokens in the same context for
  a greedy request), else the run's mean union for that window size; its draft time from the draft
  fit (d > 0; n-gram: the run's mean lookup per step, whatever it found) or, for an n-gram step
  that found nothing, the same lookup.
- With an EP placement: mean ranks touched and most experts on one rank per layer, dispatch bytes
  per committed token, for each k'.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from service import expert_parallel
from service.types import Drafter, StepRecord

REPLAY_DRAWS = 32  # random draws of the untested positions; the spread is reported
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


@dataclass(frozen=True)
class LengthPrediction:
    draft_length: int  # k'
    acceptance_per_position: tuple[float, ...]  # [k'] P(draft i accepted | drafted i)
    window_mean: float  # recorded steps truncated to k'
    unique_experts_mean: tuple[float, ...]  # [L] recorded windows truncated to k' positions + 1
    draft_seconds_per_step: float  # replayed steps
    verify_seconds_per_step: float  # replayed steps, from the window means / cost curve
    draft_seconds_per_step_truncated: float  # recorded steps truncated to k'
    verify_seconds_per_step_truncated: float
    replay_window_mean: float  # window of the replayed steps
    committed_per_step: float  # replay
    committed_per_step_spread: float  # max - min over the replay draws
    committed_per_step_truncated: float
    seconds_per_committed_token: float  # replay
    seconds_per_committed_token_truncated: float
    ep_ranks_touched_mean: tuple[float, ...] | None = None  # [L]
    ep_max_rank_experts_mean: tuple[float, ...] | None = None  # [L]
    ep_dispatch_bytes_per_token: float | None = None


@dataclass(frozen=True)
class WhatIf:
    drafter: str
    draft_temperature: float
    recorded_length: int  # k of the run
    steps: int
    requests: int
    measured_seconds_per_committed_token: float  # the run itself
    curve: CostCurve
    window_seconds: dict[int, float]  # window size -> mean verify seconds where the run has enough passes
    draft_curve: DraftCurve
    predictions: tuple[LengthPrediction, ...]  # k' = 0..k
    speculative_curve: CostCurve | None = None  # windows >= 2, fitted on those passes alone (if identified)

    @property
    def best(self) -> LengthPrediction:
        return min(self.predictions, key=lambda p: p.seconds_per_committed_token)

    def to_json(self) -> dict:
        return {**asdict(self), "best_draft_length": self.best.draft_length}


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
    plain step and the wide windows runs low at short windows (model drafter k'=2: verify -16%).
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
    no model pass), so the mean seconds of the run's lookups per step and nothing per draft (a
    proportional fit priced a k'=1 lookup at an eighth of a k=8 one). Model drafter: least squares
    of draft seconds on drafts per step when that varies and both parts come out non-negative;
    otherwise draft time proportional to the drafts."""
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


def position_outcomes(request: Sequence[StepRecord]) -> list[int | None]:
    """One request's output positions: 1 = a draft was accepted there, 0 = rejected or nothing to
    propose, None = never tested (the bonus token after a fully accepted window of k drafts)."""
    out: list[int | None] = []
    for s in request:
        a, d = s.accepted, s.drafted
        if s.committed <= a:  # EOS inside the accepted drafts ended the request
            out += [1] * s.committed
        elif a < d or d < s.draft_length or s.draft_length == 0:
            out += [1] * a + [0]  # rejected at a, or the drafter had nothing more to offer
        else:
            out += [1] * a + [None]
    return out


def position_steps(request: Sequence[StepRecord]) -> list[tuple[int, int]]:
    """Aligned with `position_outcomes`: for each output position, (the recorded step that committed
    it, its offset in that step), i.e. where a step starting there finds its window's positions in
    the recorded window (offset 0 = the recorded step's own start)."""
    out: list[tuple[int, int]] = []
    for g, s in enumerate(request):
        out += [(g, i) for i in range(min(s.committed, s.accepted + 1))]
    return out


def position_offers(request: Sequence[StepRecord], places: Sequence[tuple[int, int]]) -> list[int]:
    """Drafts the drafter would offer at a step starting at each output position (before the k'
    cap): the recorded count at a recorded start; inside a recorded accepted run the model drafter
    offers k, the n-gram lookup the recorded count (it keeps matching the same earlier span); never
    past the budget (the request's last position is always a plain step)."""
    n = len(places)
    offers = []
    for p, (g, i) in enumerate(places):
        s = request[g]
        if i == 0:
            offers.append(s.drafted)
        else:
            inside = s.draft_length if s.drafter is Drafter.MODEL else s.drafted
            offers.append(max(0, min(inside, n - p - 1)))
    return offers


def position_drafts(request: Sequence[StepRecord], places: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether a step starting at each output position runs its drafter at all (a model pass, an
    n-gram lookup): as recorded at a recorded start, else while the budget leaves room for a draft."""
    n = len(places)
    return [request[g].drafted > 0 or request[g].draft_seconds > 0 if i == 0 else n - p - 1 > 0
            for p, (g, i) in enumerate(places)]


def continue_probability(requests: Sequence[list[int | None]]) -> float:
    """P(accepted | the previous position accepted), over positions the run tested."""
    pairs = [(x, y) for r in requests for x, y in zip(r, r[1:], strict=False) if x == 1 and y is not None]
    return sum(y for _, y in pairs) / len(pairs) if pairs else 0.0


def replay_steps(outcomes: Sequence[int | None], offers: Sequence[int], k: int, p_continue: float,
                 rng: random.Random) -> list[tuple[int, int]]:
    """Windows of up to k drafts over one request's positions -> (start position, drafts) per step;
    each step commits its accepted drafts plus one token, so the steps cover every position."""
    n, p, steps = len(outcomes), 0, []
    while p < n:
        d = min(k, offers[p])
        j = 0
        while j < d and p + j < n:
            o = outcomes[p + j]
            if o is None:
                o = int(rng.random() < p_continue)
            if not o:
                break
            j += 1
        steps.append((p, d))
        p += j + 1
    return steps


@dataclass
class _Pricer:
    """Seconds of one replayed step, from what the recorded run measured (see the module docstring)."""

    curve: CostCurve
    speculative_curve: CostCurve | None  # for windows >= 2 when the run identifies one
    window_seconds: dict[int, float]
    draft_curve: DraftCurve
    nothing_found_seconds: float  # draft seconds of a step whose drafter offered nothing (n-gram: a lookup)
    union_by_window: dict[int, float]  # window size -> mean union of recorded windows cut to that size
    ids: list[np.ndarray]  # [L, w, m] per recorded step
    _unions: dict[tuple[int, int, int], float] = field(default_factory=dict)

    def union(self, g: int, i: int, w: int) -> float:
        key = (g, i, w)
        if key not in self._unions:
            routed = self.ids[g]
            if i + w <= routed.shape[1]:  # the recorded window holds all of these positions
                self._unions[key] = float(np.mean([len(np.unique(layer)) for layer in routed[:, i:i + w]]))
            else:
                wider = [x for x in self.union_by_window if x >= w]
                self._unions[key] = self.union_by_window[min(wider) if wider else max(self.union_by_window)]
        return self._unions[key]

    def verify(self, g: int, i: int, w: int) -> float:
        if w in self.window_seconds:
            return self.window_seconds[w]
        line = self.speculative_curve if w >= 2 and self.speculative_curve is not None else self.curve
        return line.seconds(w, self.union(g, i, w))

    def draft(self, kp: int, drafts: int, runs: bool) -> float:
        if kp == 0 or not runs:  # no speculation / no budget left: nothing is drafted or looked up
            return 0.0
        return self.draft_curve.seconds(drafts) if drafts else self.nothing_found_seconds


def predict(requests: Sequence[Sequence[StepRecord]], top_k: int,
            placement: expert_parallel.Placement | None = None, ep_token_bytes: int = 0,
            seed: int = 0) -> WhatIf:
    steps = [s for r in requests for s in r]
    if not steps:
        raise ValueError("no recorded steps to replay")
    if any(s.topk_ids is None for s in steps):
        raise ValueError("the recorded steps carry no top-k ids (record with capture_topk / --record-steps)")
    first = steps[0]
    policies = {(s.drafter, s.draft_length, s.draft_temperature) for s in steps}
    if len(policies) > 1:
        raise ValueError(f"steps of {len(policies)} policies; replay one policy's steps at a time")
    k = first.draft_length
    curve = fit_cost_curve(steps, top_k)
    speculative_curve = fit_speculative_curve(steps, top_k)
    draft_curve = fit_draft_curve(steps)
    by_window: dict[int, list[float]] = {}
    for s in steps:
        by_window.setdefault(s.window, []).append(s.verify_seconds)
    window_seconds = {w: statistics.fmean(v) for w, v in sorted(by_window.items()) if len(v) >= MIN_WINDOW_STEPS}
    ids = [np.asarray(s.topk_ids) for s in steps]  # [L, w, m] each
    union_by_window = {w: float(np.mean([[len(np.unique(layer)) for layer in r[:, :w]] for r in ids
                                         if r.shape[1] >= w]))
                       for w in range(1, max(r.shape[1] for r in ids) + 1)}
    # A step whose drafter offered nothing still looked (n-gram): its lookup costs what any lookup does.
    pricer = _Pricer(curve, speculative_curve, window_seconds, draft_curve, draft_curve.seconds(0),
                     union_by_window, ids)
    outcomes = [position_outcomes(r) for r in requests]
    offset = 0
    walks = []  # per request: outcomes, offers, (global recorded step, offset), drafter runs, per position
    for request, outcome in zip(requests, outcomes, strict=True):
        places = position_steps(request)
        walks.append((outcome, position_offers(request, places), [(offset + g, i) for g, i in places],
                      position_drafts(request, places)))
        offset += len(request)
    p_continue = continue_probability(outcomes)
    measured = sum(s.seconds for s in steps) / max(1, sum(s.committed for s in steps))
    predictions = [_predict_length(kp, steps, ids, walks, p_continue, pricer, placement, ep_token_bytes, seed)
                   for kp in range(k + 1)]
    return WhatIf(first.drafter.value, first.draft_temperature, k, len(steps), len(requests), measured, curve,
                  window_seconds, draft_curve, tuple(predictions), speculative_curve=speculative_curve)


def _replay_length(kp: int, walks: list, p_continue: float, pricer: _Pricer, seed: int) -> dict:
    """REPLAY_DRAWS walks at k' -> totals of steps, tokens, windows, draft and verify seconds."""
    totals = {"steps": 0, "tokens": 0, "window": 0, "draft": 0.0, "verify": 0.0}
    per_draw = []
    for draw in range(REPLAY_DRAWS):
        rng = random.Random(seed * 1000 + draw)
        steps = tokens = 0
        for outcome, offers, places, drafts in walks:
            walked = replay_steps(outcome, offers, kp, p_continue, rng)
            for p, d in walked:
                g, i = places[p]
                totals["window"] += d + 1
                totals["draft"] += pricer.draft(kp, d, drafts[p])
                totals["verify"] += pricer.verify(g, i, d + 1)
            steps, tokens = steps + len(walked), tokens + len(outcome)
        per_draw.append(tokens / max(1, steps))
        totals["steps"] += steps
        totals["tokens"] += tokens
    return {**totals, "spread": max(per_draw) - min(per_draw)}


def _predict_length(kp: int, steps: list[StepRecord], ids: list[np.ndarray], walks: list, p_continue: float,
                    pricer: _Pricer, placement: expert_parallel.Placement | None,
                    ep_token_bytes: int, seed: int) -> LengthPrediction:
    L = ids[0].shape[0]
    windows, unions, drafts, verifies, committed_trunc = [], [], [], [], []
    accepted_at, drafted_at = [0] * kp, [0] * kp
    ranks, most, dispatched = np.zeros(L), np.zeros(L), 0
    for g, (s, routed) in enumerate(zip(steps, ids, strict=True)):
        d = min(s.drafted, kp)
        a = min(s.accepted, kp)
        w = d + 1
        window_ids = routed[:, :w]  # [L, w', m] the first w' positions of the recorded window
        union = [len(np.unique(layer)) for layer in window_ids]
        windows.append(w)
        unions.append(union)
        # k' = 0 drafts nothing; a step whose drafter found nothing (n-gram) costs what it cost.
        drafts.append(0.0 if kp == 0 else s.draft_seconds if s.drafted == 0 else pricer.draft_curve.seconds(d))
        verifies.append(pricer.verify(g, 0, w))
        committed_trunc.append(min(a + 1, s.committed))
        for i in range(d):
            drafted_at[i] += 1
            accepted_at[i] += i < a
        if placement is not None:
            view = expert_parallel.pass_view(placement, window_ids, ep_token_bytes)
            ranks += view.ranks_touched
            most += view.max_rank_experts
            dispatched += view.dispatch_bytes
    n = len(steps)
    walked = _replay_length(kp, walks, p_continue, pricer, seed)
    per_step = walked["tokens"] / max(1, walked["steps"])
    trunc = statistics.fmean(committed_trunc)
    trunc_seconds = statistics.fmean(drafts) + statistics.fmean(verifies)
    return LengthPrediction(
        draft_length=kp,
        acceptance_per_position=tuple(acc / max(1, dr) for acc, dr in zip(accepted_at, drafted_at, strict=True)),
        window_mean=statistics.fmean(windows),
        unique_experts_mean=tuple(float(x) for x in np.mean(np.array(unions), axis=0)),
        draft_seconds_per_step=walked["draft"] / max(1, walked["steps"]),
        verify_seconds_per_step=walked["verify"] / max(1, walked["steps"]),
        draft_seconds_per_step_truncated=statistics.fmean(drafts),
        verify_seconds_per_step_truncated=statistics.fmean(verifies),
        replay_window_mean=walked["window"] / max(1, walked["steps"]),
        committed_per_step=per_step,
        committed_per_step_spread=walked["spread"],
        committed_per_step_truncated=trunc,
        seconds_per_committed_token=(walked["draft"] + walked["verify"]) / max(1, walked["tokens"]),
        seconds_per_committed_token_truncated=trunc_seconds / trunc,
        ep_ranks_touched_mean=tuple(float(x) for x in ranks / n) if placement is not None else None,
        ep_max_rank_experts_mean=tuple(float(x) for x in most / n) if placement is not None else None,
        ep_dispatch_bytes_per_token=dispatched / n / per_step if placement is not None else None,
    )
