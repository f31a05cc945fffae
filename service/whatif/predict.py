"""`predict(steps, ...)`: from one run recorded at draft length k, the cost of every k' <= k.

Contract (pure; steps of one policy, grouped by request, in order):
- Each recorded step is truncated to k': it would have drafted min(d, k') of its d drafts (the
  first k' drafts of a deterministic drafter, and the first k' of a sampled one are distributed
  the same), accepted min(a, k'), and verified a window of min(d, k') + 1 positions whose per-layer
  union is recounted from the first positions of the recorded top-k ids [L, w, m].
- Verify and draft seconds come from the cost model fitted on the same run (`service.whatif.fit`).
- Committed tokens per step, two ways. `truncated`: the mean of min(a, k') + 1 over the recorded
  steps, which treats steps as independent. It is biased low for k' < k: a k'-run cuts a long
  accepted run short and starts its next step inside it, where acceptance is high. `replay` (the
  estimate used) walks each request's positions as a k'-run would (`service.whatif.replay`), over
  REPLAY_DRAWS draws of the positions the run never tested.
- Seconds per committed token (`replay`) = the replayed steps' own seconds / the tokens they commit.
  The replay walks the steps a k'-run would take, so their mix is the k'-run's, not the recorded
  run's: a k'-run splits one long accepted step of the k-run into several full k'-windows, so it has
  more drafting steps (and, for the n-gram drafter, fewer steps with nothing to propose) than the
  recorded steps truncated to k'. Pricing the truncated recorded steps (the `truncated` estimate)
  is therefore biased low for k' < k in time as well as in tokens. A replayed step's window is
  priced like a recorded one (window size mean, else the cost curve), with the union recounted
  from the recorded window that holds the same positions (the same tokens in the same context for
  a greedy request), else the run's mean union for that window size; its draft time from the draft
  fit (d > 0; n-gram: the run's mean lookup per step, whatever it found) or, for an n-gram step
  that found nothing, the same lookup.
- With an EP placement: mean ranks touched and most experts on one rank per layer, dispatch bytes
  per committed token, for each k'.
- Chains only. Steps of a tree policy (StepRecord.tree_width > 1) are left out and counted
  (`WhatIf.tree_steps_skipped`): a tree's acceptance depends on its shape (how many siblings each
  depth offered), which a chain's positions do not tell, and its window is not a chain's prefix. The
  chain steps around them are replayed as separate runs, since the positions a tree step committed
  are not in the walk.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from service.routing.expert_sets import pairwise_overlap
from service.types import StepRecord
from service.whatif.fit import (
    CostCurve,
    DraftCurve,
    fit_cost_curve,
    fit_draft_curve,
    fit_speculative_curve,
    fit_window_seconds,
)
from service.whatif.replay import (
    continue_probability,
    position_drafts,
    position_offers,
    position_outcomes,
    position_steps,
    replay_steps,
)

if TYPE_CHECKING:  # the EP view imports torch: only a prediction with a placement needs it
    from service.routing import expert_parallel
    from service.whatif.profile_pricing import ProfilePricing

REPLAY_DRAWS = 32  # random draws of the untested positions; the spread is reported


@dataclass(frozen=True)
class LengthPrediction:
    draft_length: int  # k'
    acceptance_per_position: tuple[float, ...]  # [k'] P(draft i accepted | drafted i)
    window_mean: float  # recorded steps truncated to k'
    unique_experts_mean: tuple[float, ...]  # [L] recorded windows truncated to k' positions + 1
    # [L] the same windows' pairwise overlap (service/routing/expert_sets.py): mean over steps of each window's
    # mean and of its smallest pairwise intersection
    pairwise_overlap_mean: tuple[float, ...]
    pairwise_overlap_min_mean: tuple[float, ...]
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
    cost_profile: str | None = None  # the profile that priced the verify passes (None: the recording's timings)
    tree_steps_skipped: int = 0  # steps of tree policies left out: the replay predicts chains only

    @property
    def best(self) -> LengthPrediction:
        return min(self.predictions, key=lambda p: p.seconds_per_committed_token)

    def to_json(self) -> dict:
        return {**asdict(self), "best_draft_length": self.best.draft_length}


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
    num_experts: int  # at least the largest recorded id + 1: enough columns for the overlap's expert sets
    profile: ProfilePricing | None = None  # prices every verify pass when given (profile_pricing.py)
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
        if self.profile is not None:
            return self.profile.seconds(w, self.union(g, i, w))
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
            seed: int = 0, profile: ProfilePricing | None = None) -> WhatIf:
    """profile: price every verify pass (recorded windows truncated and replayed ones) with a verify-cost
    profile's model instead of the recording's own timings (service/whatif/profile_pricing.py).
    Steps of tree policies are left out (module docstring); `WhatIf.requests` then counts the chain runs."""
    requests, skipped = chain_runs(requests)
    steps = [s for r in requests for s in r]
    if not steps and skipped:
        raise ValueError(f"all {skipped} recorded steps are of tree policies: {TREES_SKIPPED_WHY}")
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
    window_seconds = fit_window_seconds(steps)
    ids = [np.asarray(s.topk_ids) for s in steps]  # [L, w, m] each
    union_by_window = {w: float(np.mean([[len(np.unique(layer)) for layer in r[:, :w]] for r in ids
                                         if r.shape[1] >= w]))
                       for w in range(1, max(r.shape[1] for r in ids) + 1)}
    # A step whose drafter offered nothing still looked (n-gram): its lookup costs what any lookup does.
    pricer = _Pricer(curve, speculative_curve, window_seconds, draft_curve, draft_curve.seconds(0),
                     union_by_window, ids, max(int(r.max()) for r in ids) + 1, profile)
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
                  window_seconds, draft_curve, tuple(predictions), speculative_curve=speculative_curve,
                  cost_profile=profile.describe() if profile is not None else None, tree_steps_skipped=skipped)


TREES_SKIPPED_WHY = "the replay predicts chains only; a tree's acceptance depends on the tree's shape"


def chain_runs(requests: Sequence[Sequence[StepRecord]]) -> tuple[list[tuple[StepRecord, ...]], int]:
    """Each request's steps split around its steps of tree policies -> (the runs of consecutive chain
    steps, how many tree steps were left out). A request without tree steps is one run, unchanged."""
    runs: list[tuple[StepRecord, ...]] = []
    skipped = 0
    for request in requests:
        run: list[StepRecord] = []
        for s in request:
            if s.tree_width > 1:
                skipped += 1
                if run:
                    runs.append(tuple(run))
                run = []
            else:
                run.append(s)
        if run:
            runs.append(tuple(run))
    return runs, skipped


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
    windows, unions, overlap_means, overlap_mins, drafts, verifies, committed_trunc = [], [], [], [], [], [], []
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
        overlap_mean, overlap_min = pairwise_overlap(window_ids, pricer.num_experts)
        overlap_means.append(overlap_mean)
        overlap_mins.append(overlap_min)
        # k' = 0 drafts nothing; a step whose drafter found nothing (n-gram) costs what it cost.
        drafts.append(0.0 if kp == 0 else s.draft_seconds if s.drafted == 0 else pricer.draft_curve.seconds(d))
        verifies.append(pricer.verify(g, 0, w))
        committed_trunc.append(min(a + 1, s.committed))
        for i in range(d):
            drafted_at[i] += 1
            accepted_at[i] += i < a
        if placement is not None:
            from service.routing import expert_parallel  # a placement exists, so torch is loaded already

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
        pairwise_overlap_mean=tuple(float(x) for x in np.mean(np.array(overlap_means), axis=0)),
        pairwise_overlap_min_mean=tuple(float(x) for x in np.mean(np.array(overlap_mins), axis=0)),
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
