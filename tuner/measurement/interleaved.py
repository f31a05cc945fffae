"""Interleaved trials: a candidate measured between two control windows, for a backend that runs
one policy at a time (or whose requests share passes, so a split would charge each arm the other's
windows).

Control, candidate, control: three windows and two policy switches. The trailing control window is
kept and, when the next trial has the same control, reused as its leading one, so a run of trials
costs two switches each. The ratio's interval also carries the drift the two control windows show
(`paired.drift_log_variance`): a machine whose speed moves between windows widens it instead of
biasing it. A prune is checked against a fresh control window before it stands (`_recheck_prune`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.space import PolicyKey
from tuner.measurement.measure import Measurement, Measurer, Outcome, PairedMeasurement
from tuner.measurement.paired import PairedRatio, drift_log_variance
from tuner.measurement.window import WindowSpec, WindowStats


class InterleavedMeasurer:
    def __init__(self, measurer: Measurer):
        self._measurer = measurer
        # The last trial's trailing control window, reusable as the next leading one.
        self._last_control: tuple[PolicyKey, WindowStats] | None = None

    def forget_control(self) -> None:
        """A trial measured another way came in between: the kept control window is stale."""
        self._last_control = None

    def measure(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        window: WindowSpec,
        prune: bool,
    ) -> PairedMeasurement:
        """Control, candidate, control; `candidate.value` is the ratio x `control.mean`."""
        measure = self._measurer.measure
        reused, self._last_control = self._last_control, None
        if reused is not None and reused[0] == control.key:
            lead = reused[1]
        else:
            before = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-before"), None, None,
                             heartbeat, window)
            if before.outcome is not Outcome.COMPLETE:
                m = Measurement(policy, Outcome.STARVED, WindowStats(policy.policy_id), float("inf"), before.seconds,
                                before.reapplied, before.other_spans)
                return PairedMeasurement(m, before.stats, control.policy, PairedRatio.of(m.stats, before.stats), 0.5)
            lead = before.stats
        cand = measure(policy, lead.seconds_per_token if prune else None, progress, heartbeat, window)
        if cand.outcome is Outcome.PRUNED:
            cand, lead = self._recheck_prune(policy, control, cand, lead, progress, heartbeat, window)
        controls, drift = lead.copy(), 0.0
        if cand.outcome is Outcome.COMPLETE:
            after = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-after"), None, None,
                            heartbeat, window)
            if after.outcome is Outcome.COMPLETE:
                controls.merge(after.stats)
                drift = drift_log_variance(lead, after.stats)
                self._last_control = (control.key, after.stats)
        ratio = PairedRatio.of(cand.stats, controls, extra_log_variance=drift)
        m = replace(cand, value=ratio.ratio * control.mean) if cand.stats.committed else cand
        return PairedMeasurement(m, controls, control.policy, ratio, 0.5)

    def _recheck_prune(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore,
        cand: Measurement,
        lead: WindowStats,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        window: WindowSpec,
    ) -> tuple[Measurement, WindowStats]:
        """An interleaved prune compares the candidate with a control window measured before it: a
        machine that slowed down in between (another tenant, a burst) prunes a good candidate, and a
        pruned policy is never measured again (duplicates reuse its result). So a control window as
        long as the candidate's runs right after it; the prune stands only if the candidate is still
        over the factor against that one. Otherwise the candidate is measured once more from the
        start against the fresh control, which becomes the lead window."""
        measure = self._measurer.measure
        size = replace(window, min_tokens=max(1, cand.stats.committed), min_steps=max(1, cand.stats.steps),
                       min_seconds=0.0)
        check = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-check"), None, None,
                        heartbeat, size)
        factor = self._measurer.prune.factor
        if check.outcome is not Outcome.COMPLETE or \
                cand.stats.seconds_per_token > factor * check.stats.seconds_per_token:
            return cand, lead
        again = measure(policy, check.stats.seconds_per_token, progress, heartbeat, window)
        return again, check.stats
