"""Speculative decoding is lossless: greedy output equals plain decoding token for token, and
sampled output follows the target distribution (a goodness-of-fit test that also rejects a
deliberately wrong acceptance rule)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from service.engine.sampling import accept, draft_probs, point_mass, sample, target_probs
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.engine_helpers import heldout_prompts, make_engine

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def plain_outputs(engine):
    prompts = heldout_prompts(3)
    return [(p, engine.generate(GenerationRequest(prompt=p, max_new_tokens=40, sampling=GREEDY), DraftPolicy()))
            for p in prompts]


@pytest.mark.parametrize("draft_length", range(1, 9))
def test_greedy_model_drafts_give_the_plain_decoding_output(engine, plain_outputs, draft_length):
    for draft_temperature in (0.0, 1.0):
        policy = DraftPolicy(draft_length=draft_length, draft_temperature=draft_temperature)
        for prompt, plain in plain_outputs:
            spec = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)
            assert spec.token_ids == plain.token_ids
            assert spec.spec.committed_tokens == spec.completion_tokens
            assert spec.spec.drafted_tokens > 0


@pytest.mark.parametrize("draft_length", [1, 3, 8])
def test_greedy_ngram_drafts_give_the_plain_decoding_output(engine, plain_outputs, draft_length):
    policy = DraftPolicy(drafter=Drafter.NGRAM, draft_length=draft_length)
    for prompt, plain in plain_outputs:
        spec = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)
        assert spec.token_ids == plain.token_ids


def _fit_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of samples to probs, pooling tokens expected fewer than 5 times."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.shape[0]).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] < 5:  # too little pooled mass to test on its own: fold it into the largest bin
        top = int(exp[:-1].argmax())
        obs[top] += obs[-1]
        exp[top] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


SAMPLING = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def spread_prompt(engine):
    """The held-out prompt whose next token is least certain, so a fit test has bins to compare.

    Prompts are cut to their last 120 characters: the end-to-end test prefills hundreds of times.
    """
    best = None
    for prompt in (p[-120:] for p in heldout_prompts(24)):
        ids = torch.tensor(engine.tokenizer.encode(prompt).ids)
        with torch.inference_mode():
            p = target_probs(engine.target.forward(ids, 0, engine.target_cache).logits[-1:], SAMPLING)[0]
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        if best is None or entropy > best[0]:
            best = (entropy, prompt, ids, p)
    _, prompt, ids, p = best
    assert int((p > 0.02).sum()) >= 3, "no held-out prompt has a spread next-token distribution"
    return prompt, ids, p


@pytest.fixture(scope="module")
def next_token_distributions(engine, spread_prompt):
    """The target's p (temperature 0.9, top-p 0.95) and the draft's logits after a real prompt."""
    _, ids, p = spread_prompt
    with torch.inference_mode():
        draft_logits = engine.draft.forward(ids, 0, engine.draft_cache).logits[-1:]
    return p.unsqueeze(0), draft_logits


def _committed_first_tokens(p, q_sampled, q_claimed, n, seed=0):
    """Draw x ~ q_sampled, run the acceptance rule told q_claimed; return the first committed token."""
    gen = torch.Generator().manual_seed(seed)
    window_p = torch.cat([p, p])  # [k+1, V] with k = 1: the second row is only used on acceptance
    out = []
    for _ in range(n):
        x = sample(q_sampled, gen)
        n_ok, _, nxt = accept(x, q_claimed, window_p, gen)
        out.append(int(x[0]) if n_ok == 1 else int(nxt[0]))
    return out


def test_acceptance_rule_reproduces_the_target_distribution(next_token_distributions):
    p, draft_logits = next_token_distributions
    q = draft_probs(draft_logits, 1.3)  # draft temperature differs from the target's 0.9
    samples = _committed_first_tokens(p[0:1], q, q, 4000)
    assert _fit_pvalue(samples, p[0]) > 1e-3


def test_point_mass_proposals_like_the_ngram_drafter_keep_the_target_distribution(next_token_distributions):
    """The n-gram drafter proposes a fixed token (q a point mass): the output still follows p."""
    p, _ = next_token_distributions
    proposed = torch.tensor([int(p[0].argsort(descending=True)[1])])  # a plausible, not the likeliest, token
    q = point_mass(proposed, p.shape[-1])
    samples = _committed_first_tokens(p[0:1], q, q, 4000)
    assert _fit_pvalue(samples, p[0]) > 1e-3


def test_acceptance_rule_told_the_wrong_draft_distribution_is_detected(next_token_distributions):
    p, draft_logits = next_token_distributions
    q_real, q_wrong = draft_probs(draft_logits, 1.3), draft_probs(draft_logits, 0.5)
    samples = _committed_first_tokens(p[0:1], q_real, q_wrong, 4000)
    assert _fit_pvalue(samples, p[0]) < 1e-6


def test_sampled_speculative_generation_follows_the_target_distribution(engine, spread_prompt):
    """End to end: the first two tokens of many seeded requests match the target's exact p."""
    prompt, ids, p1 = spread_prompt
    policy = DraftPolicy(draft_length=3, draft_temperature=1.4)
    firsts, seconds_after_top = [], []
    top = int(p1.argmax())
    for seed in range(500):
        sampling = SamplingParams(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, seed=seed)
        out = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=4, sampling=sampling), policy).token_ids
        firsts.append(out[0])
        if out[0] == top and len(out) > 1:
            seconds_after_top.append(out[1])
    assert _fit_pvalue(firsts, p1) > 1e-3
    with torch.inference_mode():
        ids2 = torch.cat([ids, torch.tensor([top])])
        p2 = target_probs(engine.target.forward(ids2, 0, engine.target_cache).logits[-1:], SAMPLING)
    assert len(seconds_after_top) > 50
    assert _fit_pvalue(seconds_after_top, p2[0]) > 1e-3


def test_same_seed_gives_the_same_sampled_output(engine):
    request = GenerationRequest(prompt=heldout_prompts(1)[0], max_new_tokens=24,
                                sampling=SamplingParams(temperature=1.0, top_k=50, seed=7))
    policy = DraftPolicy(draft_length=4, draft_temperature=0.7)
    assert engine.generate(request, policy).token_ids == engine.generate(request, policy).token_ids
