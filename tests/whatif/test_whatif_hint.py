"""The tuner's what-if hint: from a trial's recorded steps, the predicted best shorter length."""

from __future__ import annotations

import dataclasses

from service.recording import StepRecorder
from service.types import Drafter, DraftPolicy
from service.whatif.hint import hint_for_trial, user_attributes
from tests.whatif.test_whatif import H, info, synthetic_step

MEASURED = DraftPolicy(Drafter.MODEL, 3, 0.0, policy_id="study/7")


def record(path, requests, policy_id: str) -> None:
    recorder = StepRecorder(path, info(), hidden_size=H)
    for steps in requests:
        recorder.write(tuple(dataclasses.replace(s, policy_id=policy_id) for s in steps))
    recorder.close()


def test_nothing_accepted_suggests_plain_decoding(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    record(path, [[synthetic_step(3, 3, 0)] * 10] * 3, MEASURED.policy_id)
    record(path, [[synthetic_step(3, 3, 3)] * 10], "study/other")  # another trial's steps are not used
    hint = hint_for_trial(path, MEASURED)
    assert hint is not None and hint.recorded_steps == 30
    assert hint.suggested == dataclasses.replace(MEASURED, draft_length=0, policy_id="study/7/whatif-k0")
    assert sorted(hint.predicted) == [0, 1, 2, 3]
    assert hint.predicted[0] < hint.predicted[1] < hint.predicted[3]
    attrs = user_attributes(hint)
    assert attrs["whatif_best_length"] == 0 and attrs["whatif_predicted_best"] == hint.predicted[0]


def test_everything_accepted_suggests_nothing_shorter(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    record(path, [[synthetic_step(3, 3, 3)] * 10] * 3, MEASURED.policy_id)
    assert hint_for_trial(path, MEASURED) is None


def test_too_few_steps_or_plain_decoding_give_no_hint(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    record(path, [[synthetic_step(3, 3, 0)] * 5], MEASURED.policy_id)
    assert hint_for_trial(path, MEASURED) is None
    assert hint_for_trial(path, dataclasses.replace(MEASURED, draft_length=0)) is None
