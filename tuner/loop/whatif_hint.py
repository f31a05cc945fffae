"""The what-if hint: after a search trial at draft length k > 0, suggest a shorter length to try next.

The server's --record-steps file holds every step it ran, under each trial's unique policy id, so
the trial's own steps can be replayed for every k' <= k with the same drafter
(service/whatif/hint.py). The prediction is stored in the trial's user attributes, and the
predicted best shorter length is enqueued as a search trial unless that policy is already measured
or queued: the search then spends a switch on a length the recording says is promising instead of
on lengths it says are hopeless. The hint is advisory: a missing or unreadable recording is logged
(event WHATIF, attribute `whatif_error`) and the search goes on without it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState

from service.whatif.hint import LengthHint, hint_from_prediction, prediction_attributes, replay_trial, user_attributes
from tuner.loop import study as st
from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.space import SearchSpace, policy_key
from tuner.measurement.measure import Measurement, Outcome


class WhatIfHinter:
    def __init__(
        self,
        study: optuna.Study,
        space: SearchSpace,
        recording: Path | None,
        margin: float,
        min_steps: int,
        emit: Callable[[TunerEvent], None],
    ):
        """`recording`: the server's --record-steps file (None: no hints). `margin`: a shorter length
        is suggested when predicted cheaper by more than this. `min_steps`: the trial window's
        minimum of steps, the evidence the trial itself was measured on."""
        self._study = study
        self._space = space
        self._recording = recording
        self._margin = margin
        self._min_steps = min_steps
        self._emit = emit

    def replay(self, trial: optuna.Trial, m: Measurement) -> LengthHint | None:
        """Replay the trial's recorded steps (before it is told: user attributes need a running trial).
        A recording that is missing, unreadable or malformed is logged and stored as `whatif_error`,
        never raised."""
        path, policy = self._recording, m.policy
        if path is None or m.outcome is not Outcome.COMPLETE or policy.draft_length == 0:
            return None
        if policy.tree_width > 1:  # the replay predicts chains only: a tree gets no hint, and that is no error
            self._emit(TunerEvent(EventKind.WHATIF, trial.number, policy=policy,
                                  message="no hint: the replay predicts chains only"))
            return None
        try:
            result = replay_trial(path, policy, min_steps=self._min_steps)
        except (OSError, ValueError, KeyError, ArithmeticError) as e:  # RecordingError is a ValueError
            reason = f"{type(e).__name__}: {e}"
            trial.set_user_attr("whatif_error", reason)
            self._emit(TunerEvent(EventKind.WHATIF, trial.number, policy=policy, message=f"no hint: {reason}"))
            return None
        if result is None:
            trial.set_user_attr("whatif_error", f"fewer than {self._min_steps} recorded steps "
                                                f"under {policy.policy_id} in {path}")
            return None
        hint = hint_from_prediction(result, policy, self._margin)
        for key, value in (user_attributes(hint) if hint else prediction_attributes(result, policy)).items():
            trial.set_user_attr(key, value)
        return hint

    def enqueue(self, number: int, hint: LengthHint) -> None:
        """Queue the predicted best shorter length as a search trial, unless already measured or queued."""
        study, key = self._study, policy_key(hint.suggested)
        previous = st.previous_result(study, self._space, key)
        pending = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
                        if policy_key(self._space.policy_from_params(
                            t.system_attrs.get("fixed_params", t.params), "")) == key), None)
        predicted = f"{key.label()} predicted {hint.predicted_best * 1e3:.3f} ms/tok"
        if previous is not None or pending is not None:
            why = f"measured in trial {previous.number}" if previous is not None else "already queued"
            self._emit(TunerEvent(EventKind.WHATIF, number, policy=hint.suggested, message=f"{predicted}: {why}"))
            return
        study.enqueue_trial(self._space.params_of(hint.suggested),
                            user_attrs={"role": st.ROLE_SEARCH, "whatif_of": number})
        self._emit(TunerEvent(EventKind.WHATIF, number, policy=hint.suggested, message=f"{predicted}: enqueued"))
