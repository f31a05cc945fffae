"""After measuring a policy at draft length k, predict the best k' <= k for the same drafter (what-if
replay of that trial's recorded steps), so the tuner can try it next instead of spending switches
on lengths the recording already says are hopeless.

Contract: pure apart from reading the recording file. `hint_for_trial(recording_path, policy)`
replays the steps the server recorded under `policy.policy_id` (trial ids are unique, so those are
exactly the trial's steps) and returns a LengthHint, or None when there is nothing to suggest
(k = 0, no recorded steps, or no shorter length predicted cheaper by more than `margin`). The
caller enqueues `hint.suggested` (through `SearchSpace.params_of`) and stores
`user_attributes(hint)` beside the measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from service.recording import Recording, read_recording
from service.types import DraftPolicy, StepRecord
from service.whatif.predict import WhatIf, predict


@dataclass(frozen=True)
class LengthHint:
    measured: DraftPolicy
    suggested: DraftPolicy  # same drafter and temperature, draft length k'
    predicted: dict[int, float]  # k' -> predicted seconds per committed token
    recorded_steps: int

    @property
    def predicted_best(self) -> float:
        return self.predicted[self.suggested.draft_length]


def trial_requests(recording: Recording, policy_id: str) -> list[tuple[StepRecord, ...]]:
    selected = (tuple(s for s in request if s.policy_id == policy_id) for request in recording.requests)
    return [r for r in selected if r]


def hint_from_prediction(result: WhatIf, measured: DraftPolicy, margin: float = 0.05) -> LengthHint | None:
    """The cheapest predicted k' < k, if it beats the predicted cost at k by more than `margin` (relative)."""
    predicted = {p.draft_length: p.seconds_per_committed_token for p in result.predictions}
    k = measured.draft_length
    shorter = [kp for kp in predicted if kp < k]
    if not shorter or k not in predicted:
        return None
    best = min(shorter, key=predicted.__getitem__)
    if predicted[best] >= predicted[k] * (1 - margin):
        return None
    suggested = dataclasses.replace(measured, draft_length=best, policy_id=f"{measured.policy_id}/whatif-k{best}")
    return LengthHint(measured, suggested, predicted, result.steps)


def replay_trial(recording_path: Path, measured: DraftPolicy, min_steps: int = 20) -> WhatIf | None:
    """The what-if replay of the steps recorded under `measured.policy_id`; None for plain decoding
    (nothing shorter), for a tree policy (the replay predicts chains only) or fewer than `min_steps`
    recorded steps. Raises RecordingError (a ValueError) for a missing, unreadable or malformed file."""
    if measured.draft_length == 0 or measured.tree_width > 1:
        return None
    recording = read_recording(recording_path)
    requests = trial_requests(recording, measured.policy_id)
    if sum(len(r) for r in requests) < min_steps:
        return None
    return predict(requests, recording.header["top_k"])


def hint_for_trial(recording_path: Path, measured: DraftPolicy, margin: float = 0.05,
                   min_steps: int = 20) -> LengthHint | None:
    result = replay_trial(recording_path, measured, min_steps)
    return hint_from_prediction(result, measured, margin) if result is not None else None


def prediction_attributes(result: WhatIf, measured: DraftPolicy) -> dict[str, object]:
    """The replay's prediction for every k' <= k, whether or not it suggests a shorter length."""
    predicted = {p.draft_length: p.seconds_per_committed_token for p in result.predictions}
    return {
        "whatif_best_length": measured.draft_length,  # overwritten by user_attributes() when a shorter one wins
        "whatif_predicted_at_measured_length": predicted[measured.draft_length],
        "whatif_predicted": {str(k): v for k, v in sorted(predicted.items())},
        "whatif_recorded_steps": result.steps,
    }


def user_attributes(hint: LengthHint) -> dict[str, object]:
    """Stored on the measured trial: what the replay predicted, beside what was measured."""
    return {
        "whatif_best_length": hint.suggested.draft_length,
        "whatif_predicted_best": hint.predicted_best,
        "whatif_predicted_at_measured_length": hint.predicted[hint.measured.draft_length],
        "whatif_predicted": {str(k): v for k, v in sorted(hint.predicted.items())},
        "whatif_recorded_steps": hint.recorded_steps,
    }
