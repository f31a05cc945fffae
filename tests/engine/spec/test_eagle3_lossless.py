"""Speculative decoding with the EAGLE-3 draft is lossless: greedy output equals plain decoding
token for token at draft lengths 1-4 (greedy and sampled drafts), and sampled output follows the
target's joint law of the first two tokens (the fit test of test_speculative_lossless.py, with its
negative controls: the same test rejects an engine with one sampling bug each). Rejected drafts
leave nothing stale: a prompt generated after others in the same slot gives its own output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.model.eagle3 import is_eagle3_dir
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import MODELS_DIR
from service.engine.spec.sampling import draft_probs
from service.types import DraftPolicy, GenerationRequest, SamplingParams
from tests.engine.spec.test_speculative_lossless import (
    ALPHA,
    E2E_REQUESTS,
    SAMPLING,
    FirstTwoTokens,
    assert_both_paths_taken,
    assert_spread,
    entropy,
    next_token_probs,
    wrong_first_token_laws,
)
from tests.support.engine_helpers import (
    accept_bonus_from_q,
    accept_residual_from_p,
    accept_told_q_at_temperature,
    fit_power,
    heldout_prompts,
    make_engine,
    patch_engine_sampling,
)

EAGLE3_DIR = MODELS_DIR / "eagle3"
GREEDY = SamplingParams(temperature=0)
MODEL_DRAFTS = DraftPolicy(draft_length=3, draft_temperature=0.3)

pytestmark = pytest.mark.skipif(not is_eagle3_dir(EAGLE3_DIR), reason="no shipped EAGLE-3 draft")


@pytest.fixture(scope="module")
def engine():
    return make_engine(draft_dir=EAGLE3_DIR)


@pytest.fixture(scope="module")
def plain_outputs(engine):
    assert engine.runtime.draft_is_eagle3
    return [(p, engine.generate(GenerationRequest(prompt=p, max_new_tokens=40, sampling=GREEDY), DraftPolicy()))
            for p in heldout_prompts(8)]


@pytest.mark.parametrize("draft_length", range(1, 5))
def test_greedy_eagle3_drafts_give_the_plain_decoding_output(engine, plain_outputs, draft_length):
    accepted = 0
    for draft_temperature in (0.0, 1.0):
        policy = DraftPolicy(draft_length=draft_length, draft_temperature=draft_temperature)
        for prompt, plain in plain_outputs:
            spec = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)
            assert spec.token_ids == plain.token_ids
            assert spec.spec.committed_tokens == spec.completion_tokens
            assert spec.spec.drafted_tokens > 0
            accepted += sum(s.accepted for s in spec.steps)
    assert accepted > 0  # the drafts were verified, not just drafted


def test_a_one_token_prompt_drafts_from_its_second_step(engine):
    """Entry p reads token p + 1: a one-token prompt has no entry to draft from at first."""
    plain = engine.generate(GenerationRequest(prompt_token_ids=(17,), max_new_tokens=12, sampling=GREEDY),
                            DraftPolicy())
    spec = engine.generate(GenerationRequest(prompt_token_ids=(17,), max_new_tokens=12, sampling=GREEDY),
                           DraftPolicy(draft_length=3))
    assert spec.token_ids == plain.token_ids
    assert spec.steps[0].drafted == 0 and spec.spec.drafted_tokens > 0


def eagle3_next_token_logits(engine, ids: list[int]) -> torch.Tensor:
    """The EAGLE-3 draft's logits [1, V] for the token after ids, from fresh caches (-inf outside
    its vocabulary: probability 0 there)."""
    tokens, draft = torch.tensor(ids), engine.draft
    with torch.inference_mode():
        aux = engine.target.forward_ragged(tokens, RaggedBatch.build([0], [0], [len(ids)]),
                                           KVCache(engine.target.cfg, len(ids)), capture=draft.cfg.aux_layer_ids).aux
        n = len(ids) - 1  # entry p reads (aux p, token p + 1)
        logits, _ = draft.forward_ragged(engine.target.embed_tokens(tokens[1:]), draft.project_aux(aux[:-1]),
                                         RaggedBatch.build([0], [0], [n]), draft.new_cache(len(ids)),
                                         torch.tensor([n - 1]))
    full = logits.new_full((1, engine.target.cfg.vocab_size), float("-inf"))
    full[0, draft.target_ids] = logits[0]
    return full


@pytest.fixture(scope="module")
def spread_prompt(engine):
    """As test_speculative_lossless's: the short held-out snippet whose first token best tells the
    wrong engines from the right one, among spread next-token distributions (with this draft's q)."""
    def weakest_signal(ids: tuple[int, ...]) -> float:
        p = next_token_probs(engine, list(ids))
        if entropy(p) < 0.8 or int((p > 0.05).sum()) < 3:
            return 0.0
        q = draft_probs(eagle3_next_token_logits(engine, list(ids)), MODEL_DRAFTS.draft_temperature)[0]
        return min(float(((w - p) ** 2 / p.clamp(min=1e-12)).sum()) for w in wrong_first_token_laws(p, q).values())

    candidates = {tuple(engine.tokenizer.encode(p).ids[-n:]) for p in heldout_prompts(64) for n in (3, 4, 6, 8)}
    ids = max(sorted(candidates), key=weakest_signal)
    p = next_token_probs(engine, list(ids))
    assert_spread(p)
    return list(ids), p


@pytest.fixture(scope="module")
def spread_law(engine, spread_prompt):
    return FirstTwoTokens(engine, *spread_prompt)


def first_two_tokens(engine, ids: list[int], policy: DraftPolicy, requests: int = E2E_REQUESTS):
    outputs, first_steps = [], []
    for seed in range(requests):
        request = GenerationRequest(prompt_token_ids=tuple(ids), max_new_tokens=2,
                                    sampling=dataclasses.replace(SAMPLING, seed=seed))
        result = engine.generate(request, policy)
        outputs.append(result.token_ids)
        first_steps.append(result.steps[0])
    return outputs, first_steps


@pytest.mark.slow  # 400 seeded requests: ~10-40 s on 2 shared cores
def test_sampled_eagle3_drafts_give_the_target_joint_law_of_the_first_two_tokens(engine, spread_prompt, spread_law):
    outputs, first_steps = first_two_tokens(engine, spread_prompt[0], MODEL_DRAFTS)
    assert_both_paths_taken(first_steps)
    assert spread_law.pvalue(outputs) > ALPHA


WRONG_ENGINES = {
    "q without the draft temperature": accept_told_q_at_temperature(1.0, MODEL_DRAFTS.draft_temperature),
    "bonus from q": accept_bonus_from_q,
    "residual from p": accept_residual_from_p,
}


@pytest.mark.slow  # 400 seeded requests per variant
@pytest.mark.parametrize("variant", WRONG_ENGINES)
def test_the_same_fit_test_rejects_a_wrong_engine(engine, spread_prompt, spread_law, monkeypatch, variant):
    """Negative controls: the test above on an engine with one realistic sampling bug, its power
    against that bug (from the exact laws) asserted first."""
    ids, p = spread_prompt
    q = draft_probs(eagle3_next_token_logits(engine, ids), MODEL_DRAFTS.draft_temperature)[0]
    if variant == "bonus from q":
        wrong_law = spread_law.joint(p, (torch.minimum(p, q), q))
    else:
        wrong_law = spread_law.joint(wrong_first_token_laws(p, q)[variant])
    assert fit_power(spread_law.law, wrong_law, E2E_REQUESTS, ALPHA) > 0.99
    patch_engine_sampling(monkeypatch, engine, accept=WRONG_ENGINES[variant])
    outputs, _ = first_two_tokens(engine, ids, MODEL_DRAFTS)
    assert spread_law.pvalue(outputs) < ALPHA


def fresh_greedy_chain(engine, ids: list[int], k: int) -> list[int]:
    """The draft's greedy chain of k after ids, from fresh caches: what a drafter holding no state
    of earlier steps proposes."""
    draft = engine.draft
    first = eagle3_next_token_logits(engine, ids)[0].argmax().item()
    chain = [first]
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        aux = engine.target.forward_ragged(tokens, RaggedBatch.build([0], [0], [len(ids)]),
                                           KVCache(engine.target.cfg, len(ids)), capture=draft.cfg.aux_layer_ids).aux
        n, cache = len(ids) - 1, draft.new_cache(len(ids) + k)
        _, hidden = draft.forward_ragged(engine.target.embed_tokens(tokens[1:]), draft.project_aux(aux[:-1]),
                                         RaggedBatch.build([0], [0], [n]), cache, torch.tensor([n - 1]))
        for j in range(k - 1):
            logits, hidden = draft.forward_ragged(engine.target.embed_tokens(torch.tensor(chain[-1:])), hidden,
                                                  RaggedBatch.build([0], [n + j], [1]), cache,
                                                  torch.zeros(1, dtype=torch.long))
            chain.append(int(draft.target_ids[logits[0].argmax()]))
    return chain


def test_every_steps_drafts_are_those_of_a_fresh_drafter():
    """Rejected (and accepted) drafts leave no stale entry: each step's greedy drafts equal the
    chain a drafter with fresh caches proposes after the same committed tokens."""
    engine = make_engine(draft_dir=EAGLE3_DIR, capture_topk=True)
    compared = mismatched = 0
    for prompt in heldout_prompts(4):
        ids = engine.tokenizer.encode(prompt).ids
        result = engine.generate(GenerationRequest(prompt_token_ids=tuple(ids), max_new_tokens=24, sampling=GREEDY),
                                 DraftPolicy(draft_length=3, draft_temperature=0))
        committed = list(ids)
        for step in result.steps:
            drafts = list(step.window_ids[1:])
            if drafts:
                compared += 1
                mismatched += drafts != fresh_greedy_chain(engine, committed, len(drafts))
            committed += list(result.token_ids[len(committed) - len(ids):][:step.committed])
    assert compared > 20 and mismatched == 0, (mismatched, compared)
