"""Prepared draft lengths without SGLang: which lengths an adaptive EAGLE engine serves, which policy
changes are a pin of its step count and which another engine, what the step pin's hooks answer, and
what the tuner charges a trial for each kind of switch. The real thing (SGLang's adaptive EAGLE
engine, pinned under load) runs in test_sglang_cpu_step_pin.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.errors import UsageError
from service.sglang_backend.cli import prepared_lengths
from service.sglang_backend.policy import (
    SpecConfig,
    adaptive_config,
    speculative_kwargs,
    start_arguments,
    step_switch,
)
from service.sglang_plugin import step_pin
from service.types import MAX_DRAFT_LENGTH, Drafter, DraftPolicy
from tests.support.tuner_fixtures import model_info
from tuner.measurement.against_control import switch_seconds

EAGLE3 = SpecConfig(model_algorithm="EAGLE3", draft_model_path="/drafts/eagle3", prepared_lengths=(1, 2, 4),
                    adaptive_config_path="/tmp/adaptive.json")
WITH_PLAIN = SpecConfig(model_algorithm="EAGLE3", draft_model_path="/drafts/eagle3", prepared_lengths=(0, 1, 2, 4),
                        adaptive_config_path="/tmp/adaptive.json")


def model(k: int) -> DraftPolicy:
    return DraftPolicy(drafter=Drafter.MODEL, draft_length=k)


def test_prepared_lengths_default_to_every_length_where_sglang_can_switch_and_none_elsewhere():
    assert prepared_lengths("auto", "EAGLE3") == prepared_lengths("auto", "EAGLE") == tuple(
        range(MAX_DRAFT_LENGTH + 1))
    assert prepared_lengths("auto", "STANDALONE") == prepared_lengths("auto", None) == ()
    assert prepared_lengths("none", "EAGLE3") == ()
    assert prepared_lengths("4,1,2,2", "EAGLE3") == (1, 2, 4)


@pytest.mark.parametrize(("value", "algorithm", "names"), [
    ("1,2", "STANDALONE", "EAGLE and EAGLE3 only"),
    ("1,2", None, "NGRAM"),
    ("-1,2", "EAGLE3", f"0-{MAX_DRAFT_LENGTH}"),
    (f"{MAX_DRAFT_LENGTH + 1}", "EAGLE3", f"0-{MAX_DRAFT_LENGTH}"),
    ("two", "EAGLE3", "comma-separated"),
    ("0", "EAGLE3", "0 alone"),
])
def test_bad_prepared_lengths_are_a_usage_error_naming_the_problem(value, algorithm, names):
    with pytest.raises(UsageError, match="--sglang-prepared-lengths") as e:
        prepared_lengths(value, algorithm)
    assert names in str(e.value)


def test_a_prepared_length_starts_an_adaptive_engine_and_others_do_not():
    assert speculative_kwargs(model(2), EAGLE3) == {
        "speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 3, "speculative_draft_model_path": "/drafts/eagle3",
        "speculative_adaptive": True, "speculative_adaptive_config": "/tmp/adaptive.json"}
    assert "speculative_adaptive" not in speculative_kwargs(model(3), EAGLE3)  # not prepared
    assert speculative_kwargs(model(0), EAGLE3) == {}  # 0 not prepared: a plain engine
    plain_on_it = speculative_kwargs(model(0), WITH_PLAIN)  # 0 prepared: the adaptive engine at 0 steps
    assert (plain_on_it["speculative_num_steps"], plain_on_it["speculative_num_draft_tokens"]) == (0, 1)
    assert plain_on_it["speculative_adaptive"] is True
    assert speculative_kwargs(DraftPolicy(drafter=Drafter.NGRAM, draft_length=0), WITH_PLAIN) == plain_on_it
    assert "speculative_adaptive" not in speculative_kwargs(
        DraftPolicy(drafter=Drafter.NGRAM, draft_length=2), EAGLE3)
    assert adaptive_config((1, 2, 4)) == {"1": {"candidate_steps": [1, 2, 4]}}


def test_only_a_change_between_prepared_lengths_of_one_engine_is_a_pin():
    def kwargs(policy, spec=EAGLE3):
        return speculative_kwargs(policy, spec)

    assert step_switch(kwargs(model(2)), kwargs(model(4))) == 4
    assert step_switch(kwargs(model(4)), kwargs(model(1))) == 1
    assert step_switch(kwargs(model(2)), kwargs(model(3))) is None  # 3 was not prepared
    assert step_switch(kwargs(model(2)), kwargs(model(0))) is None  # plain, not prepared: another engine
    assert step_switch(kwargs(model(2), WITH_PLAIN), kwargs(model(0), WITH_PLAIN)) == 0
    assert step_switch(kwargs(model(0), WITH_PLAIN), kwargs(model(4), WITH_PLAIN)) == 4
    assert step_switch(kwargs(model(2)), kwargs(DraftPolicy(drafter=Drafter.NGRAM, draft_length=2))) is None
    assert step_switch({}, kwargs(model(2))) is None  # from a plain engine
    other_draft = SpecConfig(model_algorithm="EAGLE3", draft_model_path="/drafts/other", prepared_lengths=(1, 2, 4),
                             adaptive_config_path="/tmp/adaptive.json")
    assert step_switch(kwargs(model(2)), kwargs(model(4), other_draft)) is None


def test_an_engine_wanted_at_0_steps_starts_at_the_smallest_positive_prepared_length():
    """SGLang keeps a request's speculative counts from the start-up step count: never start at 0."""
    at_zero = speculative_kwargs(model(0), WITH_PLAIN)
    started = start_arguments(at_zero, WITH_PLAIN)
    assert (started["speculative_num_steps"], started["speculative_num_draft_tokens"]) == (1, 2)
    assert {k: v for k, v in started.items() if not k.endswith(("_steps", "_tokens"))} == {
        k: v for k, v in at_zero.items() if not k.endswith(("_steps", "_tokens"))}
    assert step_switch(started, at_zero) == 0  # then pinned to 0
    for wanted in (speculative_kwargs(model(2), WITH_PLAIN), speculative_kwargs(model(0), EAGLE3)):
        assert start_arguments(wanted, WITH_PLAIN) == wanted


class _Params:
    """Stands in for SGLang's AdaptiveSpeculativeParams: what its own methods would answer."""

    def __init__(self, current: int):
        self.current = current

    def get_steps_for_batch(self, batch_size):
        return self.current

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size):
        self.current += 1  # SGLang's rule moving the count
        return self.current


def test_the_step_pin_answers_the_pinned_count_and_never_lets_sglangs_rule_switch():
    params = _Params(current=3)
    assert step_pin.get_steps_for_batch(_Params.get_steps_for_batch, params, 8) == 3  # not pinned: SGLang's
    assert step_pin.on_verify_complete(_Params.on_verify_complete, params, [3, 3], 2) is None
    assert params.current == 3
    controller = SimpleNamespace(candidate_steps=[1, 2, 3, 4], params=params)
    scheduler = SimpleNamespace(draft_worker=SimpleNamespace(adaptive_controller=controller))
    assert step_pin._pin(scheduler, 4) == ""
    assert step_pin.get_steps_for_batch(_Params.get_steps_for_batch, params, 8) == 4
    assert "not a prepared step count" in step_pin._pin(scheduler, 5)
    assert step_pin.get_steps_for_batch(_Params.get_steps_for_batch, params, 8) == 4  # unchanged
    assert "no adaptive" in step_pin._pin(SimpleNamespace(draft_worker=None), 2)


def test_the_tuner_charges_a_trial_between_prepared_lengths_a_pin_and_any_other_an_engine_swap():
    info = model_info(prepared_draft_lengths=(1, 2, 4), length_switch_seconds=0.004, policy_switch_seconds=9.5)
    assert switch_seconds(info, model(4), model(2)) == 0.004
    assert switch_seconds(info, model(3), model(2)) == 9.5
    assert switch_seconds(info, DraftPolicy(drafter=Drafter.NGRAM, draft_length=2), model(2)) == 9.5
    assert switch_seconds(info, model(0), model(2)) == 9.5
    with_plain = model_info(prepared_draft_lengths=(0, 1, 2, 4), length_switch_seconds=0.004,
                            policy_switch_seconds=9.5)
    assert switch_seconds(with_plain, DraftPolicy(drafter=Drafter.NGRAM, draft_length=0), model(2)) == 0.004
    assert switch_seconds(info, model(2), None) == 9.5  # no control: whatever runs now may be another engine
    tree = DraftPolicy(drafter=Drafter.MODEL, draft_length=4, tree_width=2)
    assert switch_seconds(info, tree, model(2)) == switch_seconds(info, model(2), tree) == 9.5  # its own engine
    assert switch_seconds(info, DraftPolicy(drafter=Drafter.MODEL, draft_length=1, tree_width=2), model(2)) == 0.004
