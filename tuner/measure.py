"""Measure one policy online: apply it, collect its window from spans, stop on complete/starved/prune.

Contract: `Measurer.measure(policy, incumbent_value)` watches the policy id *before* applying it
(no span can be missed), then polls. While waiting it re-checks the server's policy every
`policy_check_seconds` and re-applies ours when the ids differ (the server restarted, or someone
else set a policy). It returns the window and how it ended; it never talks to Optuna.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.types import DraftPolicy
from tuner.admin import PolicyAdmin, ServerUnavailable
from tuner.collector import SpanCollector
from tuner.pruning import PruneRule
from tuner.spans import ran_policy
from tuner.window import CostModel, Objective, WindowSpec, WindowState, WindowStats


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
    ) -> Measurement:
        cfg = self._config
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
                state = cfg.window.state(stats, now - start)
                if state is not WindowState.OPEN:
                    outcome = Outcome.COMPLETE if state is WindowState.COMPLETE else Outcome.STARVED
                    other = self._collector.traffic().unwatched_spans - unwatched_before
                    return self._result(policy, outcome, stats, now - start, reapplied, other)
                value = cfg.objective.of(stats, cfg.cost)
                if cfg.prune.should_prune(
                    value, stats.committed, stats.steps, cfg.window.min_tokens, cfg.window.min_steps, incumbent_value
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

    def _result(
        self, policy: DraftPolicy, outcome: Outcome, stats: WindowStats, seconds: float, reapplied: int, other: int = 0
    ) -> Measurement:
        value = self._config.objective.of(stats, self._config.cost)
        return Measurement(policy, outcome, stats, value, seconds, reapplied, other)
