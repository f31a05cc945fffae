"""Re-proposals: the sampler asks for a policy the study has already measured.

Its result is reused instead of spending traffic on it: noise is handled by pairing and by the
re-measure phase, not by random repeats. A reused trial copies the measured trial's attributes and
points at it (`duplicate_of`); it does not count towards --trials, and the tuning loop ends the
search as converged after `max_consecutive_duplicates` of them in a row.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.space import SearchSpace, policy_key

# Attributes of the measured trial that describe that trial's run, not its result.
_NOT_COPIED = ("role", "tuner_id", "heartbeat", "whatif_of")  # a copy was not queued by a hint


def reuse_result(
    study: optuna.Study, space: SearchSpace, trial: optuna.Trial, policy: DraftPolicy, previous: FrozenTrial
) -> tuple[TrialState, float | None]:
    """Tell `trial` what `previous` (the same policy) measured; the state and value it was told."""
    for key, value in previous.user_attrs.items():
        if key not in _NOT_COPIED:
            trial.set_user_attr(key, value)
    trial.set_user_attr("duplicate_of", previous.number)
    if previous.state is TrialState.COMPLETE:
        score = next((s for s in st.scores(study, space) if s.key == policy_key(policy)), None)
        value = score.mean if score is not None else float(previous.value)  # a challenge-only policy
        study.tell(trial, value)
        return TrialState.COMPLETE, value
    step, value = max(previous.intermediate_values.items()) if previous.intermediate_values else (0, None)
    if value is not None:
        trial.report(value, step=step)
    study.tell(trial, state=TrialState.PRUNED)
    return TrialState.PRUNED, value


def reuse_incumbent(study: optuna.Study, trial: optuna.Trial, incumbent: st.PolicyScore) -> None:
    """The sampler proposed the incumbent itself as a challenger: tell it the incumbent's mean."""
    trial.set_user_attr("duplicate_of", incumbent.trials[0])
    study.tell(trial, incumbent.mean)
