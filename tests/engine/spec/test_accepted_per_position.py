"""spec.accepted_per_position means the accepted prefix on every backend: draft position i of a step
counts iff i < that step's accepted count. Checked against a recount from the tokens alone (the
drafts each verify window held vs the tokens the step committed), never from the engine's flags.

The SGLang half of the claim (its step records, built from a real SGLang dump) is in
tests/test_sglang_accepted_positions.py; both recount with tests/acceptance_recount.py.
"""

from __future__ import annotations

import json

import pytest

from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.acceptance_recount import committed_per_step, per_position_totals, recount
from tests.support.engine_helpers import PROMPTS_FILE, make_engine

REPEAT_PROMPTS = PROMPTS_FILE.parent / "repeat.jsonl"


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


def test_a_recording_with_old_style_flags_reads_back_as_the_accepted_prefix(tmp_path):
    """Recordings written before the fix hold flags of later drafts that matched after a rejection
    ("1001" with 1 accepted); read back, a step says what was accepted, as the replay assumes."""
    from service.recording import header_for, read_recording, step_line
    from service.types import ModelInfo, StepRecord

    info = ModelInfo(backend="torch", model_name="m", draft_model_name="d", num_layers=1, num_experts=16, top_k=2,
                     shared_experts=1, vocab_size=100, max_context=64, max_draft_length=8, drafters=(Drafter.NGRAM,),
                     tunable=("draft_length",), expert_bytes=1, decode_step_seconds=0.01)
    old = StepRecord(drafter=Drafter.NGRAM, draft_length=4, draft_temperature=1.0, policy_id="p", drafted=4, accepted=1,
                     committed=2, accepted_per_position=(True, False, False, True), window=5, unique_experts=(4,),
                     shared_experts=1, unique_experts_bound=10, draft_seconds=0.0, verify_seconds=0.01,
                     decode_step_equivalents=1.0, topk_ids=(tuple((0, 1) for _ in range(5)),),
                     window_ids=(1, 2, 3, 4, 5))
    path = tmp_path / "old.steps.jsonl"
    path.write_text(json.dumps(header_for(info, hidden_size=8)) + "\n" + step_line(old, 0, 16) + "\n")
    assert '"flags":"1001"' in path.read_text()
    (steps,) = read_recording(path).requests
    assert steps[0].accepted_per_position == (True, False, False, False)
