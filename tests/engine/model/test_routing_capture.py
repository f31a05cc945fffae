"""Per-layer unique-expert counts equal a recomputation from transformers' router logits for the
same verification windows, and always lie in [m, min(E, w*m)]."""

from __future__ import annotations

import pytest
import torch

from service.engine.model.weights import DEFAULT_TARGET_DIR
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import heldout_prompts, make_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine():
    return make_engine(capture_topk=True)


@pytest.fixture(scope="module")
def oracle():
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()


@pytest.mark.parametrize("policy", [DraftPolicy(draft_length=5, draft_temperature=1.0),
                                    DraftPolicy(drafter=Drafter.NGRAM, draft_length=4),
                                    DraftPolicy()], ids=["model-k5", "ngram-k4", "plain"])
def test_unique_experts_match_the_oracle_router_for_every_window(engine, oracle, policy):
    prompt = heldout_prompts(1)[0]
    request = GenerationRequest(prompt=prompt, max_new_tokens=30, sampling=SamplingParams(temperature=0.8, seed=3))
    result = engine.generate(request, policy)
    prompt_ids = engine.tokenizer.encode(prompt).ids
    committed = list(prompt_ids) + list(result.token_ids)
    start = len(prompt_ids) - 1  # each window starts at the last committed token
    m = engine.info.top_k
    for step in result.steps:
        sequence = torch.tensor(committed[:start] + list(step.window_ids))
        with torch.no_grad():
            router = oracle(sequence[None], output_router_logits=True).router_logits  # L x [T, E]
        for layer, logits in enumerate(router):
            expected_ids = logits[-step.window:].topk(m, dim=-1).indices  # [w, m]
            assert step.unique_experts[layer] == expected_ids.unique().numel()
            got = torch.tensor(step.topk_ids[layer])
            assert torch.equal(got.sort(-1).values, expected_ids.sort(-1).values)
            # The pairwise overlap of the oracle's per-position sets, by plain Python sets.
            sets = [set(row.tolist()) for row in expected_ids]
            pairs = [len(a & b) for i, a in enumerate(sets) for b in sets[i + 1:]] or [len(sets[0])]
            assert step.pairwise_overlap_mean[layer] == pytest.approx(sum(pairs) / len(pairs))
            assert step.pairwise_overlap_min[layer] == min(pairs)
        start += step.committed


def test_unique_experts_stay_within_their_bounds(engine):
    E, m = engine.info.num_experts, engine.info.top_k
    policies = (DraftPolicy(draft_length=8, draft_temperature=1.5), DraftPolicy(drafter=Drafter.NGRAM, draft_length=8))
    for policy in policies:
        for prompt in heldout_prompts(3):
            result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24), policy)
            for step in result.steps:
                assert step.unique_experts_bound == min(E, step.window * m)
                assert all(m <= u <= step.unique_experts_bound for u in step.unique_experts)
                assert len(step.unique_experts) == engine.info.num_layers
                assert step.window == step.drafted + 1


def test_plain_decoding_steps_touch_exactly_top_k_experts(engine):
    result = engine.generate(GenerationRequest(prompt="def f(x):\n", max_new_tokens=8), DraftPolicy())
    assert all(s.window == 1 and s.unique_experts == (engine.info.top_k,) * 4 for s in result.steps)
    assert sum(s.committed for s in result.steps) == result.completion_tokens
