"""Chunked prefill and the per-pass (vectorised) acceptance of the scheduler.

- A newcomer's prompt is prefilled in passes of at most `prefill_chunk` prompt tokens, one between
  two steps of the running requests: while a long prompt arrives a running request waits at most one
  bounded pass per token (counted in passes and tokens, not wall time), and the newcomer's first
  step shares the running requests' pass.
- Outputs do not depend on how the prompt was chunked: greedy identical (or the first difference at
  a near-tie, the rule of tests/engine/test_batching.py), seeded sampled identical, and sampled first
  tokens from chunked prompts follow the target's distribution.
- The batched greedy acceptance (one argmax over the pass, then plain ids per request) equals the
  per-request tensor rule `accept_greedy` on every case.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from service.engine.model.ragged import KVCache
from service.engine.spec.sampling import accept_greedy, accept_greedy_ids, target_probs
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.engine.test_batching import assert_same_or_near_tie, run_together
from tests.support.engine_helpers import fit_pvalue, heldout_prompts, make_engine

CHUNK = 16
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine():
    chunked = make_engine(prefill_chunk=CHUNK)
    yield chunked
    chunked.close()


def long_prompt(engine, tokens: int) -> str:
    """A held-out prompt of about `tokens` tokens (prompts are joined until long enough)."""
    text = "\n".join(heldout_prompts(8))
    ids = engine.tokenizer.encode(text).ids
    assert len(ids) > tokens
    return engine.tokenizer.decode(ids[-tokens:])


def while_running(engine, running: GenerationRequest, newcomers: list[tuple[GenerationRequest, DraftPolicy]]):
    """Start `running`; once it has committed 4 tokens, submit the newcomers; return every result."""
    started = threading.Event()
    committed = []

    def on_delta(delta):
        committed.extend(delta.token_ids)
        if len(committed) >= 4:
            started.set()

    with ThreadPoolExecutor(1 + len(newcomers)) as pool:
        first = pool.submit(engine.generate, running, DraftPolicy(), on_delta=on_delta)
        assert started.wait(60)
        later = [pool.submit(engine.generate, *job) for job in newcomers]
        return first.result(), [f.result() for f in later]


# ------------------------------------------------------------------------------- bounded passes


def test_a_running_request_waits_at_most_one_bounded_prefill_pass_per_token(engine):
    running = GenerationRequest(prompt="def main():\n", max_new_tokens=60, sampling=GREEDY)
    prompt = long_prompt(engine, 300)
    newcomer = GenerationRequest(prompt=prompt, max_new_tokens=4, sampling=GREEDY)
    prompt_len = len(engine.tokenizer.encode(prompt).ids)
    first, (late,) = while_running(engine, running, [(newcomer, DraftPolicy())])
    assert first.completion_tokens == 60
    waits = [s.batch.prefill_tokens for s in first.steps[1:]]  # (its own first step followed its own prompt)
    # The newcomer's prompt (all but its last token) was prefilled between the running request's
    # tokens, never more than CHUNK tokens before one of them: ceil((n - 1) / CHUNK) prefill passes.
    assert sum(waits) == prompt_len - 1 and max(waits) <= CHUNK, waits
    assert sum(1 for n in waits if n) == -(-(prompt_len - 1) // CHUNK)
    # Every pass is numbered: one prefill pass at most between two of its steps.
    ids = [s.batch.pass_id for s in first.steps[1:]]
    assert max(b - a for a, b in zip(ids, ids[1:], strict=False)) == 2
    # The newcomer's first step shared the running request's pass.
    assert late.steps[0].batch.batch_size == 2 and late.steps[0].batch.pass_id in ids


def test_a_prompt_arriving_alone_is_prefilled_whole(engine):
    """Nobody decodes, so nobody can stall: one pass carries the whole prompt, then its first step."""
    prompt = long_prompt(engine, 100)
    result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=3, sampling=GREEDY), DraftPolicy())
    assert [s.batch.prefill_tokens for s in result.steps] == [result.prompt_tokens - 1, 0, 0]


# --------------------------------------------------------------------------- outputs unchanged


def test_chunked_prompts_give_the_outputs_of_whole_prompts(engine):
    prompts = [long_prompt(engine, n) for n in (150, 90, 61)]
    policies = [DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=4),
                DraftPolicy(draft_length=3, draft_temperature=0)]
    greedy = [(GenerationRequest(prompt=p, max_new_tokens=16, sampling=GREEDY), policy)
              for p, policy in zip(prompts, policies, strict=True)]
    sampled = [(GenerationRequest(prompt=p, max_new_tokens=16,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i)), policy)
               for i, (p, policy) in enumerate(zip(prompts, policies, strict=True))]
    alone = [engine.generate(*job) for job in greedy + sampled]  # nobody decoding: each prompt whole
    assert all(r.steps[0].batch.prefill_tokens == r.prompt_tokens - 1 for r in alone)
    running = GenerationRequest(prompt="import os\n", max_new_tokens=80, sampling=GREEDY)
    first, chunked = while_running(engine, running, greedy + sampled)
    waits = [s.batch.prefill_tokens for s in first.steps[1:]]
    assert sum(waits) == sum(r.prompt_tokens - 1 for r in chunked) and max(waits) <= CHUNK, waits
    assert all(r.steps[0].batch.prefill_tokens < r.prompt_tokens - 1 for r in chunked), "a prompt went in whole"
    for (request, _), a, b in zip(greedy, alone[:3], chunked[:3], strict=True):
        reference = reference_greedy(engine, request.prompt, 16)
        assert_same_or_near_tie(engine, request.prompt, reference, a.token_ids)
        assert_same_or_near_tie(engine, request.prompt, reference, b.token_ids)
    assert [r.token_ids for r in chunked[3:]] == [r.token_ids for r in alone[3:]]


def reference_greedy(engine, prompt: str, n: int) -> tuple[int, ...]:
    """Plain greedy decoding straight on the model, one token per forward, in a private cache: the
    oracle both scheduler paths must match (a slip shared by both would pass a mutual comparison)."""
    ids = engine.tokenizer.encode(prompt).ids
    cache = KVCache(engine.target.cfg, len(ids) + n)
    out = []
    with torch.inference_mode():
        logits = engine.target.forward(torch.tensor(ids), 0, cache).logits
        for i in range(n):
            out.append(int(logits[-1].argmax()))
            logits = engine.target.forward(torch.tensor(out[-1:]), len(ids) + i, cache).logits
    return tuple(out)


def first_tokens(engine, prompt: str, sampling: SamplingParams, seeds) -> list[int]:
    """First tokens of one prompt under many seeds, 16 at a time, while a background caller keeps a
    request decoding (so every prompt is chunked: whole prompts go in only when nobody decodes)."""
    done = threading.Event()

    def keep_decoding():
        while not done.is_set():
            engine.generate(GenerationRequest(prompt="def f():\n", max_new_tokens=400, sampling=GREEDY), DraftPolicy(),
                            should_stop=done.is_set)

    jobs = [(GenerationRequest(prompt=prompt, max_new_tokens=1,
                               sampling=SamplingParams(sampling.temperature, sampling.top_p, seed=seed)), DraftPolicy())
            for seed in seeds]
    with ThreadPoolExecutor(1) as background:
        busy = background.submit(keep_decoding)
        try:
            results = run_together(engine, jobs, threads=16)
        finally:
            done.set()
        busy.result()
    chunked = sum(1 for r in results if r.steps[0].batch.prefill_tokens < r.prompt_tokens - 1)
    assert chunked > len(results) // 2, f"only {chunked} prompts were chunked over several passes"
    return [r.token_ids[0] for r in results]


def test_sampled_first_tokens_of_chunked_prompts_follow_the_target_distribution(engine):
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    ids, p = spread_prompt(engine, sampling)
    tokens = first_tokens(engine, engine.tokenizer.decode(ids.tolist()), sampling, range(400))
    assert fit_pvalue(tokens, p) > 1e-3
    # Negative control: the same draws against the distribution of the prompt without its last token
    # (what a chunk written one position off would sample from) are rejected.
    assert fit_pvalue(tokens, next_token_probs(engine, ids[:-1], sampling)) < 1e-6


def next_token_probs(engine, ids: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The target's p for the token after ids [n]: one whole pass in a private cache (the reference)."""
    with torch.inference_mode():
        logits = engine.target.forward(ids, 0, KVCache(engine.target.cfg, ids.shape[0])).logits[-1:]
    return target_probs(logits, sampling)[0]


def spread_prompt(engine, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Of 40-token held-out prompt tails (over two chunks each) that decode back to themselves, the
    one whose next token is the most uncertain: (ids [40], p [V])."""
    best = None
    for prompt in heldout_prompts(24):
        ids = engine.tokenizer.encode(prompt).ids[-40:]
        if engine.tokenizer.encode(engine.tokenizer.decode(ids)).ids != ids:
            continue
        p = next_token_probs(engine, torch.tensor(ids), sampling)
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        if best is None or entropy > best[0]:
            best = (entropy, torch.tensor(ids), p)
    assert best is not None and float(best[2].max()) < 0.8, "the test needs a spread next-token distribution"
    return best[1], best[2]


# -------------------------------------------------------------------------- batched acceptance


def test_greedy_acceptance_on_ids_equals_the_tensor_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        k = int(torch.randint(0, 9, (1,), generator=gen))
        target = torch.randint(0, 4, (k + 1,), generator=gen)  # a tiny vocabulary: long matching prefixes
        draft = torch.randint(0, 4, (k,), generator=gen)
        n, ok, nxt = accept_greedy(draft, target)
        assert accept_greedy_ids(draft.tolist(), target.tolist()) == (n, tuple(ok.tolist()), int(nxt))


def test_the_unions_of_every_window_in_one_scatter_equal_one_count_per_window():
    from service.engine.step_records import unique_experts_per_layer, unique_experts_per_window

    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        lengths = torch.randint(1, 6, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        routed = torch.randint(0, 16, (3, sum(lengths), 4), generator=gen)  # [L, N, m], 16 experts: overlaps
        own, whole = unique_experts_per_window(routed, lengths, 16)
        assert own == [unique_experts_per_layer(w, 16) for w in routed.split(lengths, dim=1)]
        assert whole == unique_experts_per_layer(routed, 16)


def test_the_pairwise_overlaps_of_every_window_in_one_matmul_equal_plain_sets_per_window():
    import itertools

    from service.engine.step_records import StepRecords

    m = 4
    records = StepRecords(num_experts=16, top_k=m)
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        lengths = torch.randint(1, 6, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        routed = torch.stack([torch.stack([torch.randperm(16, generator=gen)[:m] for _ in range(sum(lengths))])
                              for _ in range(3)])  # [L, N, m], distinct ids per position as top-k gives
        for got, window in zip(records.overlaps(routed, lengths), routed.split(lengths, dim=1), strict=True):
            sets = [[set(p.tolist()) for p in layer] for layer in window]
            pairs = [[len(a & b) for a, b in itertools.combinations(layer, 2)] or [m] for layer in sets]
            assert got["pairwise_overlap_min"] == tuple(min(p) for p in pairs)
            assert got["pairwise_overlap_mean"] == pytest.approx([sum(p) / len(p) for p in pairs])


def test_a_dense_draft_takes_the_prompt_in_the_prefill_pass_and_its_first_step_feeds_one_token():
    """Counted on the real draft model (wrapped, still run): its cache holds the prompt after the
    prefill pass, bitwise what a fresh forward over the prompt writes, so the first step's drafting
    feeds the last prompt token alone, not the whole prompt."""
    from service.engine.model.weights import DEFAULT_DRAFT_DIR

    engine = make_engine(draft_dir=DEFAULT_DRAFT_DIR)
    fed: list[int] = []
    forward = engine.draft.forward_ragged

    def counting(tokens, *args, **kwargs):
        fed.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    engine.draft.forward_ragged = counting
    try:
        prompt = long_prompt(engine, 40)
        ids = engine.tokenizer.encode(prompt).ids
        result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=6, sampling=GREEDY),
                                 DraftPolicy(drafter=Drafter.MODEL, draft_length=2, draft_temperature=0.0))
    finally:
        engine.draft.forward_ragged = forward
        engine.close()
    assert result.completion_tokens == 6 and fed[0] == 1, fed
    fresh = KVCache(engine.draft.cfg, engine.max_context)
    with torch.inference_mode():
        engine.draft.forward(torch.tensor(ids[:-1]), 0, fresh)
    n = len(ids) - 1
    assert any(torch.equal(engine.runtime.draft_cache.k[:, slot, :, :n], fresh.k[:, 0, :, :n])
               for slot in range(engine.runtime.draft_cache.slots))
