"""StepRecord.of_policy, the constructor both backends build their step records with: the policy's
four fields are copied as they are, the union's bound is min(E, window * m), the optional fields
pass through."""

from __future__ import annotations

import dataclasses

import pytest

from service.types import Drafter, DraftPolicy, StepRecord

POLICY = DraftPolicy(drafter=Drafter.NGRAM, draft_length=4, draft_temperature=0.5, policy_id="candidate")


def record(window: int, num_experts: int, top_k: int, **optional) -> StepRecord:
    return StepRecord.of_policy(POLICY, drafted=window - 1, accepted=1, committed=2,
                                accepted_per_position=(True,) + (False,) * (window - 2), window=window,
                                unique_experts=(9, 12), shared_experts=1, num_experts=num_experts, top_k=top_k,
                                draft_seconds=0.001, verify_seconds=0.004, decode_step_equivalents=1.6, **optional)


def test_the_policy_fields_are_copied():
    r = record(5, 64, 8)
    assert (r.drafter, r.draft_length, r.draft_temperature, r.policy_id) == (Drafter.NGRAM, 4, 0.5, "candidate")
    assert (r.drafted, r.accepted, r.committed, r.window) == (4, 1, 2, 5)


@pytest.mark.parametrize(("window", "num_experts", "top_k", "bound"), [(5, 64, 8, 40), (9, 64, 8, 64), (1, 64, 8, 8)])
def test_the_union_bound_is_the_smaller_of_all_experts_and_window_times_top_k(window, num_experts, top_k, bound):
    assert record(window, num_experts, top_k).unique_experts_bound == bound


def test_optional_fields_pass_through_and_unknown_ones_are_refused():
    r = record(2, 64, 8, window_ids=(5, 6), ep_dispatch_bytes=128)
    assert r.window_ids == (5, 6) and r.ep_dispatch_bytes == 128 and r.topk_ids is None
    assert dataclasses.replace(r, window_ids=None).window_ids is None
    with pytest.raises(TypeError):
        record(2, 64, 8, not_a_field=1)
