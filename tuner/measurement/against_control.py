"""How one trial's candidate is measured against its control, by `TrialMode`.

Sequential (or no control yet, or the candidate is the control itself): the candidate alone,
pruned against the control's mean. Paired: beside the control in one traffic split
(`Measurer.measure_paired`). Interleaved: control, candidate, control windows
(`interleaved.InterleavedMeasurer`). The trial window is stretched where a policy switch is
expensive, so switching stays a small part of the time spent measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from service.types import Drafter, DraftPolicy, ModelInfo
from tuner.loop import study as st
from tuner.loop.space import policy_key
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.interleaved import InterleavedMeasurer
from tuner.measurement.measure import Measurement, Measurer, PairedMeasurement, TrialMode
from tuner.measurement.window import WindowSpec, WindowStats


class AgainstControl:
    def __init__(self, measurer: Measurer, admin: PolicyAdmin, mode: TrialMode, switch_window_factor: float):
        self._measurer = measurer
        self._admin = admin
        self._mode = mode
        self._switch_window_factor = switch_window_factor
        self._interleaved = InterleavedMeasurer(measurer)

    def measure(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore | None,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        prune: bool,
        share: float,
        fresh_control: bool = False,
    ) -> Measurement | PairedMeasurement:
        """Measure `policy` the configured way against `control` (alone when there is none yet).

        fresh_control: never lead an interleaved trial with the control window kept from the last
        trial. Continuous mode's rounds ask it: the incumbent served alone, unmeasured, for the idle
        time between them, and a kept window from before a workload shift, merged with the window
        after the candidate, charges the candidate the old workload's cheaper control (after a shift
        to sampled requests, plain read ~1.3x a drafting incumbent that was in truth dearer)."""
        if fresh_control:
            self._interleaved.forget_control()
        mode, window = self._mode, self.window(policy, control.policy if control is not None else None)
        if control is None or mode is TrialMode.SEQUENTIAL or control.key == policy_key(policy):
            self._interleaved.forget_control()
            prune_against = control.mean if control is not None and prune else None
            return self._measurer.measure(policy, prune_against, progress, heartbeat, window)
        control_policy = replace(control.policy, policy_id=f"{policy.policy_id}/control")
        if mode is TrialMode.PAIRED:
            self._interleaved.forget_control()
            return self._measurer.measure_paired(policy, control_policy, share, control.mean, progress, heartbeat,
                                                 window, prune)
        return self._interleaved.measure(policy, control, progress, heartbeat, window, prune)

    def window(self, policy: DraftPolicy | None = None, control: DraftPolicy | None = None) -> WindowSpec:
        """The trial window, stretched where a policy switch is expensive: every window lasts at
        least `switch_window_factor` x what the backend last measured for the kind of switch this
        trial makes, so switching costs at most ~1/factor of the time spent measuring."""
        base = self._measurer.window
        factor = self._switch_window_factor
        switch = switch_seconds(self._admin.model_info(), policy, control) if factor > 0 else 0.0
        if switch <= 0:
            return base
        floor = factor * switch
        return replace(base, min_seconds=max(base.min_seconds, floor), max_seconds=base.max_seconds + floor)


def switch_seconds(info: ModelInfo, policy: DraftPolicy | None, control: DraftPolicy | None) -> float:
    """What the backend last measured for switching between a trial's candidate and its control: a pin of
    the draft length where both are lengths it prepared (SGLang's adaptive EAGLE engine: model-drafter
    chain lengths, and 0), else an engine swap (0 on a backend that switches policies for free)."""
    def prepared(p: DraftPolicy) -> bool:  # k = 0 is plain decoding whichever drafter the policy names
        chain = p.tree_width == 1 or p.draft_length <= 1  # a tree runs on an engine of its own
        return p.draft_length in info.prepared_draft_lengths and (p.draft_length == 0 or p.drafter is Drafter.MODEL
                                                                  and chain)

    if policy is not None and control is not None and prepared(policy) and prepared(control):
        return info.length_switch_seconds
    return info.policy_switch_seconds
