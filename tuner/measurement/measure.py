"""Measure policies online: apply, collect windows from spans, stop on complete/starved/prune.

Contract: `Measurer.measure(policy, incumbent_value)` watches the policy id *before* applying it
(no span can be missed), then polls. While waiting it re-checks the server's policy every
`policy_check_seconds` and re-applies ours when the ids differ (the server restarted, or someone
else set a policy). It returns the window and how it ended; it never talks to Optuna.
`measure_paired(candidate, control, share, control_value)` does the same for a traffic split of two
arms: the candidate gets `share` of the requests, the control the rest, interleaved request by
request; the window completes when *both* arms hold a full window, and the value is the
candidate/control ratio (`tuner.measurement.paired`) times `control_value`.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.policy.traffic import TrafficArm, TrafficSplit
from service.types import DraftPolicy
from tuner.loop.pruning import PruneRule
from tuner.measurement.admin import PolicyAdmin, ServerUnavailable
from tuner.measurement.collector import SpanCollector
from tuner.measurement.paired import PairedRatio
from tuner.measurement.spans import ran_policy
from tuner.measurement.window import CostModel, Objective, WindowSpec, WindowState, WindowStats


class TrialMode(enum.StrEnum):
    """How a trial's candidate is compared (docs/tuner.md: which mode `auto` picks, paired and interleaved trials)."""

    PAIRED = "paired"  # beside the control (the incumbent) in one traffic split, request by request
    INTERLEAVED = "interleaved"  # control, candidate, control windows: a backend with one policy at a time
    SEQUENTIAL = "sequential"  # the candidate alone; its absolute cost is the value (drift goes in with it)


class Outcome(enum.StrEnum):
    COMPLETE = "complete"
    STARVED = "starved"  # max wall time passed without enough tokens/steps
    PRUNED = "pruned"  # running cost far worse than the incumbent


@dataclass(frozen=True)
class Measurement:
    policy: DraftPolicy
    outcome: Outcome
    stats: WindowStats
    value: float  # the objective over the window (inf when nothing was committed)
    seconds: float  # wall time the measurement took
    reapplied: int  # times the policy had to be re-applied (server restarts)
    other_spans: int = 0  # request spans for other policy ids that arrived meanwhile (diagnosis)


@dataclass(frozen=True)
class PairedMeasurement:
    """A candidate measured beside a control (`candidate.value` = ratio x the control's value)."""

    candidate: Measurement
    control: WindowStats
    control_policy: DraftPolicy
    ratio: PairedRatio
    share: float  # the candidate's share of the traffic (0.5 for interleaved windows of equal size)


def paired_window(window: WindowSpec, share: float) -> WindowSpec:
    """The candidate fills its window at `share` of the traffic: its wall-time limit grows to match
    (unchanged at an even split)."""
    return replace(window, max_seconds=window.max_seconds * max(1.0, 0.5 / share))


@dataclass(frozen=True)
class MeasureConfig:
    window: WindowSpec
    prune: PruneRule
    objective: Objective
    cost: CostModel
    poll_seconds: float = 0.25
    policy_check_seconds: float = 1.0


class Measurer:
    def __init__(
        self,
        admin: PolicyAdmin,
        collector: SpanCollector,
        config: MeasureConfig,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._admin = admin
        self._collector = collector
        self._config = config
        self._clock = clock

    @property
    def window(self) -> WindowSpec:
        return self._config.window

    @property
    def prune(self) -> PruneRule:
        return self._config.prune

    def measure(
        self,
        policy: DraftPolicy,
        incumbent_value: float | None = None,
        on_progress: Callable[[WindowStats], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        window: WindowSpec | None = None,
    ) -> Measurement:
        cfg = self._config
        window = window or cfg.window
        self._collector.watch(policy.policy_id, accept=lambda sample: ran_policy(sample, policy))
        unwatched_before = self._collector.traffic().unwatched_spans
        try:
            self._admin.apply(policy)
            start = last_check = self._clock()
            reapplied = 0
            seen = 0
            while True:
                stats = self._collector.wait(policy.policy_id, seen, cfg.poll_seconds)
                now = self._clock()
                if stats.requests != seen:
                    seen = stats.requests
                    if on_progress:
                        on_progress(stats)
                state = window.state(stats, now - start)
                if state is not WindowState.OPEN:
                    outcome = Outcome.COMPLETE if state is WindowState.COMPLETE else Outcome.STARVED
                    other = self._collector.traffic().unwatched_spans - unwatched_before
                    return self._result(policy, outcome, stats, now - start, reapplied, other)
                value = cfg.objective.of(stats, cfg.cost)
                if cfg.prune.should_prune(
                    value, stats.committed, stats.steps, window.min_tokens, window.min_steps, incumbent_value
                ):
                    return self._result(policy, Outcome.PRUNED, stats, now - start, reapplied)
                if now - last_check >= cfg.policy_check_seconds:
                    last_check = now
                    if heartbeat:
                        heartbeat()
                    # Server down: keep waiting; the window's wall-time limit decides, and the
                    # spans of requests it finished before going down may still arrive.
                    with contextlib.suppress(ServerUnavailable):
                        reapplied += int(self._admin.ensure(policy))
        finally:
            self._collector.unwatch(policy.policy_id)

    def measure_paired(
        self,
        candidate: DraftPolicy,
        control: DraftPolicy,
        share: float,
        control_value: float,
        on_progress: Callable[[WindowStats], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
        window: WindowSpec | None = None,
        prune: bool = True,
    ) -> PairedMeasurement:
        cfg = self._config
        window = paired_window(window or cfg.window, share)
        split = TrafficSplit((TrafficArm(control, 1.0 - share), TrafficArm(candidate, share)))
        for policy in (candidate, control):
            self._collector.watch(policy.policy_id, accept=lambda sample, p=policy: ran_policy(sample, p))
        unwatched_before = self._collector.traffic().unwatched_spans
        try:
            self._admin.apply_split(split)
            start = last_check = self._clock()
            reapplied = seen = 0
            while True:
                cand = self._collector.wait(candidate.policy_id, seen, cfg.poll_seconds)
                ctrl = self._collector.snapshot(control.policy_id)
                now = self._clock()
                if cand.requests != seen:
                    seen = cand.requests
                    if on_progress:
                        on_progress(cand)
                states = {window.state(cand, now - start), window.state(ctrl, now - start)}
                ratio = PairedRatio.of(cand, ctrl)
                value = ratio.ratio * control_value
                if states == {WindowState.COMPLETE} or WindowState.STARVED in states:
                    outcome = Outcome.COMPLETE if states == {WindowState.COMPLETE} else Outcome.STARVED
                    other = self._collector.traffic().unwatched_spans - unwatched_before
                    m = Measurement(candidate, outcome, cand, value, now - start, reapplied, other)
                    return PairedMeasurement(m, ctrl, control, ratio, share)
                # Both arms need data before a ratio means anything, and the candidate must be worse with
                # confidence (its whole interval above 1): one slow control request cannot prune it.
                judged = min(cand.committed, ctrl.committed)
                if prune and math.isfinite(value) and ratio.worse and cfg.prune.should_prune(
                    value, judged, min(cand.steps, ctrl.steps), window.min_tokens, window.min_steps, control_value
                ):
                    m = Measurement(candidate, Outcome.PRUNED, cand, value, now - start, reapplied)
                    return PairedMeasurement(m, ctrl, control, ratio, share)
                if now - last_check >= cfg.policy_check_seconds:
                    last_check = now
                    if heartbeat:
                        heartbeat()
                    with contextlib.suppress(ServerUnavailable):
                        reapplied += int(self._admin.ensure_split(split))
        finally:
            self._collector.unwatch(candidate.policy_id)
            self._collector.unwatch(control.policy_id)

    def _result(
        self, policy: DraftPolicy, outcome: Outcome, stats: WindowStats, seconds: float, reapplied: int, other: int = 0
    ) -> Measurement:
        value = self._config.objective.of(stats, self._config.cost)
        return Measurement(policy, outcome, stats, value, seconds, reapplied, other)
