"""Telling Optuna how a measured trial ended, with the evidence stored beside the value.

A trial is COMPLETE with the objective, PRUNED (the running cost reported as an intermediate value
first, so samplers still learn from it) when far worse than its control, or FAIL with a
`fail_reason` that says why (a starved window: what arrived and what the window needed). The
window's accounting, the paired ratio and its control go into the trial's user attributes, so the
report and a restarted tuner read the same record the decision was made on.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from tuner.loop import study as st
from tuner.loop.pruning import PruneRule
from tuner.loop.space import policy_key
from tuner.measurement.measure import Measurement, Outcome, PairedMeasurement, TrialMode
from tuner.measurement.window import WindowSpec


def tell_measured(
    study: optuna.Study,
    trial: optuna.Trial,
    m: Measurement,
    best: st.PolicyScore | None,
    paired: PairedMeasurement | None,
    window_attrs: dict[str, object],
    mode: TrialMode,
    window: WindowSpec,
    prune: PruneRule,
) -> TrialState:
    """`window_attrs`: the window's accounting as user attributes; `mode`: the configured trial mode;
    `window` and `prune`: the base window and prune rule, quoted in the reasons."""
    for key, value in window_attrs.items():
        trial.set_user_attr(key, value)
    trial.set_user_attr("trial_mode", mode.value if paired else TrialMode.SEQUENTIAL.value)
    if paired is not None:
        for key, value in paired.ratio.as_attrs().items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("control_policy", policy_key(paired.control_policy).label())
        trial.set_user_attr("control_value", best.mean if best else None)
        trial.set_user_attr("control_seconds_per_token",
                            paired.control.seconds_per_token if paired.control.committed else None)
        trial.set_user_attr("candidate_share", paired.share)
    trial.set_user_attr("window_seconds", round(m.seconds, 3))
    trial.set_user_attr("policy_reapplied", m.reapplied)
    if m.outcome is Outcome.COMPLETE:
        study.tell(trial, m.value)
        return TrialState.COMPLETE
    if m.outcome is Outcome.PRUNED:
        trial.report(m.value, step=m.stats.committed)
        against = "incumbent" if paired is None or mode is TrialMode.PAIRED else "control window"
        trial.set_user_attr(
            "prune_reason",
            f"running cost {m.value:.4g} > {prune.factor} x {against} {best.mean:.4g} "
            f"after {m.stats.committed} tokens",
        )
        study.tell(trial, state=TrialState.PRUNED)
        return TrialState.PRUNED
    tell_failed(
        study,
        trial,
        f"{st.FAIL_STARVED}: {m.stats.committed} tokens / {m.stats.steps} steps / {m.stats.requests} requests in "
        f"{m.seconds:.1f} s (need {window.min_tokens} tokens and {window.min_steps} steps; "
        f"{m.other_spans} spans of other policies arrived meanwhile)",
    )
    return TrialState.FAIL


def tell_failed(study: optuna.Study, trial: optuna.Trial, reason: str) -> None:
    try:
        trial.set_user_attr("fail_reason", reason)
    except optuna.exceptions.UpdateFinishedTrialError:
        return  # interrupted after it was told: its result stands
    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
