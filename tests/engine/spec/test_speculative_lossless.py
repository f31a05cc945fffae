"""Speculative decoding is lossless: greedy output equals plain decoding token for token, and
sampled output follows the target distribution. The end-to-end fit test runs through
`Engine.generate` for the model drafter (sampled and greedy drafts) and the n-gram drafter, and is
shown to reject engines with one deliberate sampling bug each (negative controls kept below); no
token outside the top-k / top-p support is ever emitted, checked against transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.model.ragged import KVCache
from service.engine.model.weights import DEFAULT_TARGET_DIR
from service.engine.spec import ngram
from service.engine.spec.sampling import accept, draft_probs, point_mass, sample, target_probs
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import (
    accept_bonus_from_q,
    accept_residual_from_p,
    accept_told_q_at_temperature,
    draft_next_token_logits,
    fit_power,
    fit_pvalue,
    heldout_prompts,
    make_engine,
    patch_engine_sampling,
    transformers_target_probs,
)

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


SAMPLING = SamplingParams(temperature=0.9, top_p=0.95)
E2E_REQUESTS = 400  # seeded requests per end-to-end fit test
ALPHA = 1e-3  # the fit test's level: a lossless engine must stay above it, every wrong engine fall below
# A cool draft (T = 0.3): its q differs from p enough that every wrong engine below is visible.
MODEL_DRAFTS = DraftPolicy(draft_length=3, draft_temperature=0.3)


def next_token_probs(engine, ids: list[int], sampling: SamplingParams = SAMPLING) -> torch.Tensor:
    """The target's p after ids (one fresh prefill, outside the decode loop) [V]."""
    with torch.inference_mode():
        cache = KVCache(engine.target.cfg, len(ids))
        return target_probs(engine.target.forward(torch.tensor(ids), 0, cache).logits[-1:], sampling)[0]


def entropy(p: torch.Tensor) -> float:
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def assert_spread(p: torch.Tensor) -> None:
    """The power of every fit test below rests on this: several likely next tokens, not one."""
    assert entropy(p) > 0.8 and int((p > 0.05).sum()) >= 3, (entropy(p), p.topk(4).values)


def draft_next_token_probs(engine, ids: list[int], temperature: float) -> torch.Tensor:
    return draft_probs(draft_next_token_logits(engine, ids), temperature)[0]


def first_token_law_told_q(p: torch.Tensor, q: torch.Tensor, told: torch.Tensor) -> torch.Tensor:
    """First committed token's law when x ~ q is judged against `told` (the rule's q): accepted
    with min(1, p/told), else drawn from norm(max(0, p - told)). told = q gives p back."""
    accepted = q * (p / told.clamp(min=1e-30)).clamp(max=1)
    residual = (p - told).clamp(min=0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


def wrong_first_token_laws(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the first-token law becomes under the wrong engines below (k = 1), from p and q."""
    told = q.pow(MODEL_DRAFTS.draft_temperature / 1.0)
    overlap = torch.minimum(p, q)
    return {
        "q without the draft temperature": first_token_law_told_q(p, q, told / told.sum()),
        "residual from p": overlap + (1 - overlap.sum()) * p,
    }


@pytest.fixture(scope="module")
def spread_prompt(engine):
    """The short held-out snippet (its last 2-8 tokens; the hundreds of prefills
    stay cheap) whose first token best tells the wrong engines from the right one, among those
    whose next token is spread (several likely tokens: the fit test has bins to compare)."""
    def weakest_signal(ids: tuple[int, ...]) -> float:
        p = next_token_probs(engine, list(ids))
        if entropy(p) < 0.8 or int((p > 0.05).sum()) < 3:
            return 0.0
        q = draft_next_token_probs(engine, list(ids), MODEL_DRAFTS.draft_temperature)
        return min(float(((w - p) ** 2 / p.clamp(min=1e-12)).sum()) for w in wrong_first_token_laws(p, q).values())

    candidates = {tuple(engine.tokenizer.encode(p).ids[-n:]) for p in heldout_prompts(64) for n in (2, 3, 4, 5, 6, 8)}
    ids = max(sorted(candidates), key=weakest_signal)
    p = next_token_probs(engine, list(ids))
    assert_spread(p)
    return engine.tokenizer.decode(list(ids)), list(ids), p


def ngram_proposal(engine, ids: list[int]) -> int | None:
    proposal = ngram.propose(list(ids), 1, engine.config.ngram_min, engine.config.ngram_max)
    return proposal[0] if proposal else None


def first_token_law_residual_from_p_point_mass(p: torch.Tensor, x: int) -> torch.Tensor:
    """First-token law when a point-mass proposal x is judged right but a rejection draws from p."""
    wrong = (1 - p[x]) * p
    wrong[x] = p[x] * (2 - p[x])
    return wrong


@pytest.fixture(scope="module")
def repeated_prompt(engine):
    """A held-out snippet followed by its own first 2-3 tokens, so the n-gram drafter proposes the
    snippet's next token at the first step; chosen so a residual drawn from p would show most (the
    proposal neither certain nor unlikely under p), among spread next-token distributions."""
    def signal(ids: tuple[int, ...]) -> float:
        x = ngram_proposal(engine, list(ids))
        p = next_token_probs(engine, list(ids))
        if x is None or entropy(p) < 0.8 or int((p > 0.05).sum()) < 3:
            return 0.0
        return float(((first_token_law_residual_from_p_point_mass(p, x) - p) ** 2 / p.clamp(min=1e-12)).sum())

    tokenized = [engine.tokenizer.encode(p).ids for p in heldout_prompts(16)]
    candidates = {tuple(ids[-n:] + ids[-n:][:m]) for ids in tokenized for n in (4, 6, 8) for m in (2, 3)}
    ids = max(sorted(candidates), key=signal)
    p = next_token_probs(engine, list(ids))
    assert_spread(p)
    return engine.tokenizer.decode(list(ids)), list(ids), p


@pytest.fixture(scope="module")
def next_token_distributions(engine, spread_prompt):
    """The target's p (temperature 0.9, top-p 0.95) and the draft's logits after a real prompt."""
    _, ids, p = spread_prompt
    return p.unsqueeze(0), draft_next_token_logits(engine, ids)


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
    assert fit_pvalue(samples, p[0]) > 1e-3


def test_point_mass_proposals_like_the_ngram_drafter_keep_the_target_distribution(next_token_distributions):
    """The n-gram drafter proposes a fixed token (q a point mass): the output still follows p."""
    p, _ = next_token_distributions
    proposed = torch.tensor([int(p[0].argsort(descending=True)[1])])  # a plausible, not the likeliest, token
    q = point_mass(proposed, p.shape[-1])
    samples = _committed_first_tokens(p[0:1], q, q, 4000)
    assert fit_pvalue(samples, p[0]) > 1e-3


def test_acceptance_rule_told_the_wrong_draft_distribution_is_detected(next_token_distributions):
    p, draft_logits = next_token_distributions
    q_real, q_wrong = draft_probs(draft_logits, 1.3), draft_probs(draft_logits, 0.5)
    samples = _committed_first_tokens(p[0:1], q_real, q_wrong, 4000)
    assert fit_pvalue(samples, p[0]) < 1e-6


# ------------------------------------------------------------------ end to end, through generate()
class FirstTwoTokens:
    """The exact joint law of a request's first two tokens, p(t1) p(t2 | t1), binned for a fit test:
    one bin per (t1, t2) for the likely t1 (p >= 0.02), one bin for every other first token."""

    def __init__(self, engine, ids: list[int], p1: torch.Tensor):
        self.head = [t for t in p1.argsort(descending=True).tolist() if p1[t] >= 0.02]
        assert engine.runtime.eos_id not in self.head  # a one-token output would fall outside the bins
        self.p1, self.V = p1, p1.shape[0]
        self.p2 = {t: next_token_probs(engine, ids + [t]) for t in self.head}
        self.law = self.joint(p1)

    def joint(self, first: torch.Tensor, second_after_accepted: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Binned law for first-token law `first`; optionally, when t1 was an accepted draft (joint
        mass accepted[t1]), t2 ~ `bonus` instead of p(. | t1)."""
        law = torch.zeros(len(self.head) * self.V + 1, dtype=torch.float64)
        for h, t in enumerate(self.head):
            row = first[t] * self.p2[t].double()
            if second_after_accepted is not None:
                accepted, bonus = second_after_accepted
                row = row + accepted[t] * (bonus.double() - self.p2[t].double())
            law[h * self.V:(h + 1) * self.V] = row
        law[-1] = 1 - float(first[self.head].sum())
        return law

    def bin(self, tokens: tuple[int, ...]) -> int:
        if len(tokens) == 2 and tokens[0] in self.head:
            return self.head.index(tokens[0]) * self.V + tokens[1]
        return len(self.law) - 1

    def pvalue(self, outputs: list[tuple[int, ...]]) -> float:
        return fit_pvalue([self.bin(t) for t in outputs], self.law)


def first_two_tokens(engine, ids: list[int], policy: DraftPolicy, requests: int = E2E_REQUESTS):
    """Seeded requests of two new tokens after the prompt ids (the exact ids the law was computed
    for; the first step drafts k = 1, its bonus is the second token) -> (token pairs, first steps)."""
    outputs, first_steps = [], []
    for seed in range(requests):
        request = GenerationRequest(prompt_token_ids=tuple(ids), max_new_tokens=2,
                                    sampling=dataclasses.replace(SAMPLING, seed=seed))
        result = engine.generate(request, policy)
        outputs.append(result.token_ids)
        first_steps.append(result.steps[0])
    return outputs, first_steps


def assert_both_paths_taken(first_steps) -> None:
    """Acceptance and rejection of the first draft both common: each half of the rule is tested."""
    drafted = [s for s in first_steps if s.drafted]
    assert len(drafted) == len(first_steps), "the first step did not always draft"
    accepted = sum(s.accepted > 0 for s in drafted) / len(drafted)
    assert 0.15 < accepted < 0.85, accepted


@pytest.fixture(scope="module")
def spread_law(engine, spread_prompt):
    _, ids, p = spread_prompt
    return FirstTwoTokens(engine, ids, p)


@pytest.mark.slow  # 400 seeded requests: ~10-40 s on 2 shared cores
def test_sampled_model_drafts_give_the_target_joint_law_of_the_first_two_tokens(engine, spread_prompt, spread_law):
    outputs, first_steps = first_two_tokens(engine, spread_prompt[1], MODEL_DRAFTS)
    assert_both_paths_taken(first_steps)
    assert spread_law.pvalue(outputs) > ALPHA


WRONG_ENGINES = {
    "q without the draft temperature": accept_told_q_at_temperature(1.0, MODEL_DRAFTS.draft_temperature),
    "bonus from q": accept_bonus_from_q,
    "residual from p": accept_residual_from_p,
}


@pytest.mark.slow  # 400 seeded requests: ~10-40 s on 2 shared cores
@pytest.mark.parametrize("variant", WRONG_ENGINES)
def test_the_same_fit_test_rejects_a_wrong_engine(engine, spread_prompt, spread_law, monkeypatch, variant):
    """Negative controls: the end-to-end test above, on an engine with one realistic sampling bug.
    Its power against that bug, from the exact laws, is asserted first: the prompt was chosen for it."""
    _, ids, p = spread_prompt
    q = draft_next_token_probs(engine, ids, MODEL_DRAFTS.draft_temperature)
    if variant == "bonus from q":  # t1 right; after an accepted draft, t2 ~ the draft's q of t1's position
        wrong_law = spread_law.joint(p, (torch.minimum(p, q), q))
    else:
        wrong_law = spread_law.joint(wrong_first_token_laws(p, q)[variant])
    assert fit_power(spread_law.law, wrong_law, E2E_REQUESTS, ALPHA) > 0.99
    patch_engine_sampling(monkeypatch, engine, accept=WRONG_ENGINES[variant])
    outputs, _ = first_two_tokens(engine, spread_prompt[1], MODEL_DRAFTS)
    assert spread_law.pvalue(outputs) < ALPHA


@pytest.mark.slow  # 400 seeded requests: ~10-40 s on 2 shared cores
def test_sampled_ngram_drafts_give_the_target_joint_law_of_the_first_two_tokens(engine, repeated_prompt):
    _, ids, p = repeated_prompt
    law = FirstTwoTokens(engine, ids, p)
    # Power against a residual drawn from p (with a point mass, the bug n-gram drafting would show).
    wrong = law.joint(first_token_law_residual_from_p_point_mass(p, ngram_proposal(engine, ids)))
    assert fit_power(law.law, wrong, E2E_REQUESTS, ALPHA) > 0.99
    outputs, first_steps = first_two_tokens(engine, ids, DraftPolicy(drafter=Drafter.NGRAM, draft_length=3))
    assert_both_paths_taken(first_steps)  # the same proposal every time: q a point mass
    assert law.pvalue(outputs) > ALPHA


@pytest.mark.slow  # 400 seeded requests: ~10-40 s on 2 shared cores
def test_greedy_draft_with_a_sampled_target_gives_the_target_joint_law(engine, spread_prompt, spread_law):
    """Draft temperature 0: q is a point mass at the draft's argmax, the target still samples."""
    outputs, first_steps = first_two_tokens(engine, spread_prompt[1], DraftPolicy(draft_length=3, draft_temperature=0))
    assert_both_paths_taken(first_steps)
    assert spread_law.pvalue(outputs) > ALPHA


SUPPORT_CASES = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.3, top_p=0.5)]


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()


def tokens_outside_the_support(engine, oracle, prompt: str, params: SamplingParams, policy: DraftPolicy,
                               requests: int = 6) -> tuple[int, int]:
    """Generate, then ask transformers (its model, its warpers) whether each output token was in
    the top-k / top-p support where it was emitted -> (tokens outside, tokens checked).

    Margin: the two models' fp32 logits differ by ~1e-5, so a token counts as outside only when
    it is outside even with the cut widened by 1e-4 (top-p mass, top-k logit)."""
    prompt_ids = engine.tokenizer.encode(prompt).ids
    outside = checked = 0
    for seed in range(requests):
        sampling = dataclasses.replace(params, seed=seed)
        out = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, sampling=sampling), policy).token_ids
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt_ids + list(out)])).logits[0, len(prompt_ids) - 1:-1]  # [n, V]
        widened = dataclasses.replace(params, top_p=min(1.0, params.top_p + 1e-4))
        kept = transformers_target_probs(logits, widened) > 0
        if params.top_k:
            kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
            kept |= logits >= kth - 1e-4
        outside += sum(not kept[i, t] for i, t in enumerate(out))
        checked += len(out)
    return outside, checked


@pytest.mark.parametrize("params", SUPPORT_CASES, ids=str)
def test_no_token_outside_the_top_k_top_p_support_is_ever_emitted(engine, oracle, params):
    """Hot model drafts and n-gram proposals often fall outside the support; none may be emitted."""
    prompt = heldout_prompts(2)[1][-300:]
    for policy in (DraftPolicy(draft_length=4, draft_temperature=1.5), DraftPolicy(Drafter.NGRAM, 4)):
        outside, checked = tokens_outside_the_support(engine, oracle, prompt, params, policy)
        assert outside == 0 and checked > 100, (policy, outside, checked)


def test_the_support_check_sees_an_engine_that_ignores_top_k_and_top_p(engine, oracle, monkeypatch):
    """Negative control: target_probs with only the temperature applied (the filters dropped)."""
    def temperature_only(logits, params):
        return target_probs(logits, SamplingParams(temperature=params.temperature))

    patch_engine_sampling(monkeypatch, engine, target_probs=temperature_only)
    prompt = heldout_prompts(2)[1][-300:]
    outside, _ = tokens_outside_the_support(engine, oracle, prompt, SUPPORT_CASES[0], DraftPolicy(Drafter.NGRAM, 4))
    assert outside > 0


def test_same_seed_gives_the_same_sampled_output(engine):
    request = GenerationRequest(prompt=heldout_prompts(1)[0], max_new_tokens=24,
                                sampling=SamplingParams(temperature=1.0, top_k=50, seed=7))
    policy = DraftPolicy(draft_length=4, draft_temperature=0.7)
    assert engine.generate(request, policy).token_ids == engine.generate(request, policy).token_ids
