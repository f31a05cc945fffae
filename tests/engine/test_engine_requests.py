"""Request handling: validation names the bad field, stop strings and EOS end output, streaming
equals the final text, cancellation stops within a step."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from service.types import (
    Drafter,
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
)
from tests.support.engine_helpers import heldout_prompts, make_engine


@pytest.fixture(scope="module")
def engine():
    return make_engine()


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=" ".join(str(i) for i in range(600))), "prompt"),
    (dict(prompt_token_ids=(1, 5000)), "prompt_token_ids"),
    (dict(prompt_token_ids=(-1,)), "prompt_token_ids"),
    (dict(prompt="a", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="a", max_new_tokens=10_000), "max_new_tokens"),
    (dict(prompt="a", sampling=SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(prompt="a", sampling=SamplingParams(temperature=math.nan)), "sampling.temperature"),
    (dict(prompt="a", sampling=SamplingParams(temperature=math.inf)), "sampling.temperature"),
    (dict(prompt="a", sampling=SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(prompt="a", sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(prompt="a", sampling=SamplingParams(top_k=-2)), "sampling.top_k"),
    (dict(prompt="a", stop=("",)), "stop"),
    (dict(prompt="a", stop=("x",) * 20), "stop"),
]


@pytest.mark.parametrize("fields,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_request_raises_an_error_naming_the_field(engine, fields, field):
    with pytest.raises(InvalidRequest) as info:
        engine.generate(GenerationRequest(**fields), DraftPolicy())
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("policy,field", [
    (DraftPolicy(draft_length=-1), "policy.draft_length"),
    (DraftPolicy(draft_length=9), "policy.draft_length"),
    (DraftPolicy(draft_length=2, draft_temperature=math.nan), "policy.draft_temperature"),
    (DraftPolicy(draft_length=2, draft_temperature=-0.5), "policy.draft_temperature"),
])
def test_bad_policy_raises_an_error_naming_the_field(engine, policy, field):
    with pytest.raises(InvalidRequest) as info:
        engine.generate(GenerationRequest(prompt="a"), policy)
    assert info.value.field == field


def test_stop_string_ends_the_output_before_it(engine):
    prompt = heldout_prompts(1)[0]
    greedy = SamplingParams(temperature=0)
    free = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=greedy), DraftPolicy())
    stop = free.text[10:13]
    assert stop
    stopped = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=greedy, stop=(stop,)),
                              DraftPolicy(draft_length=3))
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == free.text[:free.text.index(stop)]


def test_max_new_tokens_is_exact_with_speculation(engine):
    for k in (0, 3, 8):
        result = engine.generate(GenerationRequest(prompt="import os\n", max_new_tokens=13),
                                 DraftPolicy(drafter=Drafter.MODEL, draft_length=k))
        if result.finish_reason == FinishReason.LENGTH:
            assert result.completion_tokens == 13
        assert sum(s.committed for s in result.steps) == result.completion_tokens


def test_streamed_deltas_concatenate_to_the_final_text(engine):
    free_request = GenerationRequest(prompt=heldout_prompts(2)[1], max_new_tokens=32,
                                     sampling=SamplingParams(temperature=1.0, seed=11))
    free = engine.generate(free_request, DraftPolicy(draft_length=3))
    # A stop string from this seed's own output (the same seed reaches it again) that straddles two
    # steps: its first half is text a stream must hold back until the next step tells.
    ends, done = [], 0
    for step in free.steps:
        done += step.committed
        ends.append(len(engine.decode(list(free.token_ids[:done]))))
    cut = next(b - 2 for b in ends[len(ends) // 3:] if b - 2 > 0 and free.text.find(free.text[b - 2:b + 2]) == b - 2
               and len(free.text[b - 2:b + 2]) == 4)
    stop = free.text[cut:cut + 4]
    deltas = []
    result = engine.generate(dataclasses.replace(free_request, stop=(stop,)), DraftPolicy(draft_length=3),
                             on_delta=deltas.append)
    assert "".join(d.text for d in deltas) == result.text
    assert sum(len(d.token_ids) for d in deltas) == result.completion_tokens
    # The stop string fired (the held-back text was never streamed), it did not just happen to be absent.
    assert result.finish_reason == FinishReason.STOP
    assert result.text == free.text[:cut]


def test_should_stop_cancels_within_one_step():
    """At one step per call the stop is polled before every step (with several steps per call, between
    calls: tests/engine/test_steps_in_one_call.py)."""
    calls = []

    def stop_after_three():
        calls.append(1)
        return len(calls) > 3

    engine = make_engine(steps_per_call=1)
    try:
        result = engine.generate(GenerationRequest(prompt="def f():\n", max_new_tokens=200), DraftPolicy(),
                                 should_stop=stop_after_three)
    finally:
        engine.close()
    assert result.finish_reason == FinishReason.CANCELLED
    assert len(result.steps) == 3


def test_concurrent_callers_get_their_own_outputs(engine):
    from concurrent.futures import ThreadPoolExecutor

    requests = [GenerationRequest(prompt=p, max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=i))
                for i, p in enumerate(heldout_prompts(4))]
    alone = [engine.generate(r, DraftPolicy(draft_length=2)).token_ids for r in requests]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda r: engine.generate(r, DraftPolicy(draft_length=2)).token_ids, requests))
    assert together == alone


def test_eos_ends_the_output_mid_window_and_is_kept_in_token_ids(engine):
    """Make a token the greedy continuation really produces act as EOS: output ends right after it,
    also when it arrives inside an accepted speculative window, and committed counts still add up."""
    request = GenerationRequest(prompt=heldout_prompts(1)[0], max_new_tokens=32, sampling=SamplingParams(temperature=0))
    free = engine.generate(request, DraftPolicy()).token_ids
    eos = free[5]
    cut = free[:free.index(eos) + 1]
    real_eos = engine.runtime.eos_id
    engine.runtime.eos_id = eos
    try:
        for policy in (DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=6),
                       DraftPolicy(draft_length=6, draft_temperature=0)):
            result = engine.generate(request, policy)
            assert result.token_ids == cut
            assert result.finish_reason == FinishReason.STOP
            assert sum(s.committed for s in result.steps) == result.completion_tokens == len(cut)
            assert all(s.committed == s.accepted + 1 for s in result.steps[:-1])
    finally:
        engine.runtime.eos_id = real_eos


def test_decode_step_equivalents_are_verify_seconds_over_the_current_decode_step(engine):
    """Each step's decode_step_equivalents = its verify seconds / the engine's decode-step seconds
    at that step (start-up calibration until 8 plain steps were seen, then their running median)."""
    seen = []

    def check(delta):  # runs right after the step's record was built, before the next step
        seen.append((delta.step, engine.runtime.clock.decode_step_seconds()))

    # A prompt the shipped model continues without EOS: 70 plain steps fill the 64-step history.
    request = GenerationRequest(prompt="def add(a, b):", max_new_tokens=70, sampling=SamplingParams(temperature=0))
    for policy in (DraftPolicy(), DraftPolicy(draft_length=3, draft_temperature=0)):
        engine.generate(request, policy, on_delta=check)
    plain = [s.verify_seconds for s, _ in seen if s.window == 1]
    assert len(plain) >= 70 and any(s.window > 1 for s, _ in seen)
    for step, unit in seen:
        assert step.decode_step_equivalents == pytest.approx(step.verify_seconds / unit, rel=1e-12)
    # The unit is now the median of the last 64 plain steps, not the start-up calibration.
    assert engine.runtime.clock.decode_step_seconds() == pytest.approx(statistics.median(plain[-64:]), rel=1e-12)
    assert engine.runtime.clock.decode_step_seconds() != engine.decode_step_seconds
