"""spec.accepted_per_position means the accepted prefix on every backend: draft position i of a step
counts iff i < that step's accepted count. Checked against a recount from the tokens alone (the
drafts each verify window held vs the tokens the step committed), never from the engine's flags.

The SGLang half of the claim (its step records, built from a real SGLang dump) is in
tests/test_sglang_accepted_positions.py; both use `recount` below.
"""

from __future__ import annotations

import json

import pytest

from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams, StepRecord
from tests.engine_helpers import PROMPTS_FILE, make_engine

REPEAT_PROMPTS = PROMPTS_FILE.parent / "repeat.jsonl"


def recount(drafts: list[int], committed: list[int]) -> tuple[bool, ...]:
    """Per drafted position: accepted iff it and every draft before it equal the token committed there.

    A step commits its accepted drafts and then the target's own token, which differs from the first
    rejected draft (greedy: it is the argmax the draft missed; sampled: the residual has no mass on
    the rejected token), so the matching prefix is exactly the accepted run."""
    out, run = [], True
    for i, token in enumerate(drafts):
        run = run and i < len(committed) and committed[i] == token
        out.append(run)
    return tuple(out)


def committed_per_step(steps: tuple[StepRecord, ...], token_ids: tuple[int, ...], skip: int = 0) -> list[list[int]]:
    """The output tokens each step committed, in order (`skip`: leading tokens no step committed)."""
    out, at = [], skip
    for s in steps:
        out.append(list(token_ids[at:at + s.committed]))
        at += s.committed
    assert at == len(token_ids), "the steps' committed counts must cover the output"
    return out


def per_position_totals(flags: list[tuple[bool, ...]], k: int) -> tuple[int, ...]:
    return tuple(sum(int(f[i]) for f in flags if i < len(f)) for i in range(k))


@pytest.fixture(scope="module")
def engine():
    e = make_engine(capture_topk=True)  # capture_topk keeps each window's token ids in its step
    yield e
    e.close()


def _prompts(count: int) -> list[str]:
    return [json.loads(line)["prompt"] for line in REPEAT_PROMPTS.read_text().splitlines()[:count]]


@pytest.mark.parametrize("drafter", [Drafter.NGRAM, Drafter.MODEL])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_torch_per_position_acceptance_equals_the_recount_from_tokens(engine, drafter, temperature):
    k = 4
    policy = DraftPolicy(drafter, k, 1.0, policy_id="p")
    tested = 0
    for seed, prompt in enumerate(_prompts(4)):
        request = GenerationRequest(prompt=prompt, max_new_tokens=24,
                                    sampling=SamplingParams(temperature=temperature, seed=seed))
        result = engine.generate(request, policy)
        committed = committed_per_step(result.steps, result.token_ids)
        recounted = []
        for step, tokens in zip(result.steps, committed, strict=True):
            drafts = list(step.window_ids[1:1 + step.drafted])  # the window: last committed token, then drafts
            expected = recount(drafts, tokens)
            assert step.accepted_per_position == expected, (step, tokens)
            assert sum(expected) == step.accepted
            recounted.append(expected)
            tested += step.drafted
        assert result.spec.accepted_per_position == per_position_totals(recounted, k)
        assert sum(result.spec.accepted_per_position) == result.spec.accepted_tokens
    assert tested > 0, "no step drafted anything: the check tested nothing"
