"""Continuous batching: a request's output does not depend on what else runs with it, speculation
stays lossless with mixed policies in one pass, requests join and leave between steps, and every
pass reports the union of the experts all its positions picked.

The rule for greedy outputs (batch vs alone): tokens are identical, or the first difference falls
where the alone run's top-2 target logits are closer than `NEAR_TIE` (fp32 sums over a different
batch may round differently; nothing else may change a token). Seeded sampled outputs must be
identical (a flip would need a uniform draw within ~1e-6 of a probability boundary).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from service.engine.kernels.library import build as build_kernels
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference
from service.types import Drafter, DraftPolicy, FinishReason, GenerationRequest, SamplingParams
from tests.support.engine_helpers import fit_pvalue, heldout_prompts, make_engine, patch_engine_sampling

NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine():
    return make_engine(capture_topk=True)


@pytest.fixture(scope="module")
def bf16_engine():
    return make_engine(capture_topk=True, math="bf16")


@pytest.fixture(scope="module")
def amx_engine(engine):
    if not engine.target.kernels.amx_native:
        pytest.skip("no AMX tile unit on this CPU or kernel")
    return make_engine(capture_topk=True, math="amx")


@pytest.fixture(params=["fp32", "bf16", "amx"])
def either_engine(request, engine):
    """The float32 reference arithmetic, bf16 (the default where the CPU has native bf16 products) and
    AMX (the default where it has the tile unit): each keeps every row's arithmetic its own, so batching
    may change no output in any."""
    return engine if request.param == "fp32" else request.getfixturevalue(f"{request.param}_engine")


def run_together(engine, jobs: list[tuple[GenerationRequest, DraftPolicy]], threads: int | None = None):
    """Every job from its own caller thread at once: the scheduler batches whatever is in flight."""
    with ThreadPoolExecutor(threads or len(jobs)) as pool:
        return list(pool.map(lambda job: engine.generate(*job), jobs))


def assert_same_or_near_tie(engine, prompt: str, alone: tuple[int, ...], batched: tuple[int, ...]) -> None:
    diverged = next((i for i, (x, y) in enumerate(zip(alone, batched, strict=False)) if x != y), None)
    if diverged is None:
        assert len(alone) == len(batched)
        return
    ids = torch.tensor(engine.tokenizer.encode(prompt).ids + list(alone[:diverged]))
    with torch.inference_mode():  # a private cache: the engine may be serving others meanwhile
        top2 = engine.target.forward(ids, 0, KVCache(engine.target.cfg, ids.shape[0])).logits[-1].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"outputs differ at token {diverged} where the top-2 logit gap is {gap:.2e}"


def biggest_batch(result) -> int:
    return max(s.batch.batch_size for s in result.steps)


# ------------------------------------------------------------------------------------------- model


def test_a_ragged_pass_equals_each_window_run_in_its_own_slot():
    """Windows of different lengths at different positions in one pass, against one pass each."""
    model = load_for_inference(DEFAULT_TARGET_DIR)
    cfg = model.cfg
    prompts = [torch.tensor(ids) for ids in ([5, 17, 300, 42, 7, 8, 9], [1000, 3, 4], [77, 78, 79, 80, 81])]
    windows = [torch.tensor([11, 12, 13]), torch.tensor([14]), torch.tensor([15, 16, 17, 18, 19])]
    alone_cache, batch_cache = KVCache(cfg, 64, slots=3), KVCache(cfg, 64, slots=3)
    with torch.inference_mode():
        for slot, p in enumerate(prompts):
            model.forward(p, 0, alone_cache, slot)
            model.forward(p, 0, batch_cache, slot)
        alone = [model.forward(w, p.shape[0], alone_cache, slot)
                 for slot, (p, w) in enumerate(zip(prompts, windows, strict=True))]
        batch = RaggedBatch.build([0, 1, 2], [p.shape[0] for p in prompts], [w.shape[0] for w in windows])
        together = model.forward_ragged(torch.cat(windows), batch, batch_cache)
    torch.testing.assert_close(together.logits, torch.cat([o.logits for o in alone]), atol=1e-4, rtol=1e-4)
    assert torch.equal(together.routed_ids.sort(-1).values,
                       torch.cat([o.routed_ids for o in alone], dim=1).sort(-1).values)
    torch.testing.assert_close(batch_cache.k, alone_cache.k, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("fast", [False, True], ids=["eager", "kernels"])
@pytest.mark.parametrize("length", [9, 200])
def test_a_cache_only_prefill_writes_what_a_full_pass_writes(length, fast):
    """`fill_cache` skips the output layer and the last layer's MLP, and with the kernels the last
    layer's queries, attention and o_proj (its keys and values only): the cache must not notice."""
    model = load_for_inference(DEFAULT_TARGET_DIR, kernels=build_kernels() if fast else None)
    prompt = torch.arange(3, 3 + length) * 7 % model.cfg.vocab_size
    full, cache_only = KVCache(model.cfg, 256), KVCache(model.cfg, 256)
    with torch.inference_mode():
        model.forward(prompt, 0, full)
        model.fill_cache(prompt, RaggedBatch.build([0], [0], [length]), cache_only)
    assert torch.equal(cache_only.k, full.k) and torch.equal(cache_only.v, full.v)


def test_logits_of_chosen_rows_are_those_rows_of_the_full_pass():
    model = load_for_inference(DEFAULT_TARGET_DIR)
    lengths = [5, 1, 30]  # 36 rows: the full pass takes sgemm for the output layer, the 3 picked rows the kernel
    tokens = torch.arange(100, 100 + sum(lengths))
    batch = RaggedBatch.build([0, 1, 2], [0, 0, 0], lengths)
    rows = torch.tensor(lengths).cumsum(0) - 1
    with torch.inference_mode():
        full = model.forward_ragged(tokens, batch, KVCache(model.cfg, 64, slots=3))
        picked = model.forward_ragged(tokens, batch, KVCache(model.cfg, 64, slots=3), logit_rows=rows)
    torch.testing.assert_close(picked.logits, full.logits[rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(picked.routed_ids, full.routed_ids)


# ----------------------------------------------------------------------------------- invariance


def test_greedy_outputs_at_concurrency_16_equal_the_outputs_alone(either_engine):
    engine = either_engine
    prompts = [p[-200:] for p in heldout_prompts(16)]
    policies = [DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=4),
                DraftPolicy(draft_length=3, draft_temperature=0)]
    jobs = [(GenerationRequest(prompt=p, max_new_tokens=24, sampling=GREEDY), policies[i % 3])
            for i, p in enumerate(prompts)]
    alone = [engine.generate(*job) for job in jobs]
    together = run_together(engine, jobs)
    assert max(biggest_batch(r) for r in together) >= 8, "the requests never shared a pass"
    for (request, _), a, b in zip(jobs, alone, together, strict=True):
        assert_same_or_near_tie(engine, request.prompt, a.token_ids, b.token_ids)


def test_seeded_sampled_outputs_at_concurrency_16_equal_the_outputs_alone(either_engine):
    engine = either_engine
    prompts = [p[-200:] for p in heldout_prompts(16)]
    policies = [DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=3),
                DraftPolicy(draft_length=2, draft_temperature=0.8)]
    jobs = [(GenerationRequest(prompt=p, max_new_tokens=24,
                               sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)), policies[i % 3])
            for i, p in enumerate(prompts)]
    alone = [engine.generate(*job).token_ids for job in jobs]
    together = run_together(engine, jobs)
    assert max(biggest_batch(r) for r in together) >= 8, "the requests never shared a pass"
    assert [r.token_ids for r in together] == alone


# ----------------------------------------------------------------------------------- lossless


def test_mixed_policies_in_one_batch_give_the_plain_greedy_output(either_engine):
    engine = either_engine
    prompts = [p[-200:] for p in heldout_prompts(4)]
    policies = [DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=8),
                DraftPolicy(draft_length=2, draft_temperature=1.0), DraftPolicy(draft_length=5, draft_temperature=0)]
    plain = [engine.generate(GenerationRequest(prompt=p, max_new_tokens=32, sampling=GREEDY), DraftPolicy())
             for p in prompts]
    jobs = [(GenerationRequest(prompt=p, max_new_tokens=32, sampling=GREEDY), policy)
            for p in prompts for policy in policies]
    together = run_together(engine, jobs)
    assert max(biggest_batch(r) for r in together) >= 8
    for (request, _), result in zip(jobs, together, strict=True):
        expected = plain[prompts.index(request.prompt)]
        assert_same_or_near_tie(engine, request.prompt, expected.token_ids, result.token_ids)


@pytest.fixture(scope="module")
def spread_prompt(engine):
    """A held-out prompt whose next token is uncertain, and the target's p for it."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    best = None
    from service.engine.spec.sampling import target_probs

    for prompt in (p[-120:] for p in heldout_prompts(24)):
        ids = torch.tensor(engine.tokenizer.encode(prompt).ids)
        with torch.inference_mode():
            p = target_probs(engine.target.forward(ids, 0, engine.runtime.target_cache).logits[-1:], sampling)[0]
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        if best is None or entropy > best[0]:
            best = (entropy, prompt, p)
    return best[1], best[2], sampling


def first_tokens(engine, prompt, sampling, policies, seeds):
    jobs = [(GenerationRequest(prompt=prompt, max_new_tokens=2,  # 2: a policy may draft one token
                               sampling=SamplingParams(sampling.temperature, sampling.top_p, seed=seed)),
             policies[seed % len(policies)]) for seed in seeds]
    results = run_together(engine, jobs, threads=16)
    assert max(biggest_batch(r) for r in results) >= 8
    return [r.token_ids[0] for r in results]


MIXED = [DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=3),
         DraftPolicy(draft_length=1, draft_temperature=1.4), DraftPolicy(draft_length=3, draft_temperature=0)]


def test_requests_sharing_a_pass_are_each_charged_the_whole_pass_and_model_info_says_so(engine):
    """Why the tuner does not compare policies in one traffic split on this engine: a plain request
    in a pass beside an n-gram k=8 window is charged that whole pass (ModelInfo.shared_passes)."""
    prompts = [p[-200:] for p in heldout_prompts(2)]
    # The plain request is the long one, so the n-gram one starts while it runs even on a loaded
    # machine (with 24 tokens each, one finished before the other started once).
    policies = (DraftPolicy(), DraftPolicy(drafter=Drafter.NGRAM, draft_length=8))
    jobs = [(GenerationRequest(prompt=p, max_new_tokens=n, sampling=GREEDY), policy)
            for p, n, policy in zip(prompts, (96, 24), policies, strict=True)]
    plain, ngram = run_together(engine, jobs)
    ngram_steps = {s.batch.pass_id: s for s in ngram.steps}
    shared = [(s, ngram_steps[s.batch.pass_id]) for s in plain.steps if s.batch.pass_id in ngram_steps]
    assert shared, "the two requests never shared a pass"
    for mine, theirs in shared:
        assert mine.window == 1 and mine.batch.positions == 1 + theirs.window
        assert mine.verify_seconds == theirs.verify_seconds == mine.batch.verify_seconds
    assert engine.info.shared_passes
    alone = make_engine(max_batch=1)
    try:
        assert not alone.info.shared_passes
    finally:
        alone.close()


def test_sampled_first_tokens_from_a_mixed_batch_follow_the_target_distribution(engine, spread_prompt):
    prompt, p, sampling = spread_prompt
    tokens = first_tokens(engine, prompt, sampling, MIXED, range(400))
    assert fit_pvalue(tokens, p) > 1e-3


def test_a_wrong_acceptance_rule_in_the_batch_path_is_detected(engine, spread_prompt, monkeypatch):
    """Negative control for the test above: accepting every draft makes the output follow q, not p."""
    from service.engine.spec.sampling import sample

    def accept_everything(draft, q, p, generator):
        k = draft.shape[0]
        return k, torch.ones(k, dtype=torch.bool), sample(p[k:k + 1], generator)

    patch_engine_sampling(monkeypatch, engine, accept=accept_everything)
    prompt, p, sampling = spread_prompt
    tokens = first_tokens(engine, prompt, sampling, [DraftPolicy(draft_length=1, draft_temperature=1.4)], range(400))
    assert fit_pvalue(tokens, p) < 1e-6


# ------------------------------------------------------------------------------ batch records


def test_batch_union_is_the_recount_of_every_position_in_the_pass(engine):
    prompts = [p[-200:] for p in heldout_prompts(6)]
    policies = [DraftPolicy(draft_length=3, draft_temperature=1.0), DraftPolicy(drafter=Drafter.NGRAM, draft_length=6),
                DraftPolicy()]
    jobs = [(GenerationRequest(prompt=p, max_new_tokens=20, sampling=SamplingParams(temperature=0.8, seed=i)),
             policies[i % 3]) for i, p in enumerate(prompts)]
    results = run_together(engine, jobs)
    passes: dict[int, list] = {}
    for result in results:
        for step in result.steps:
            passes.setdefault(step.batch.pass_id, []).append(step)
    m, E = engine.info.top_k, engine.info.num_experts
    assert any(len(steps) >= 4 for steps in passes.values())
    for steps in passes.values():
        record = steps[0].batch
        assert all(s.batch is record for s in steps)
        assert record.batch_size == len(steps)  # every request the pass served reported this step
        assert record.positions == sum(s.window for s in steps) == sum(record.windows)
        assert sorted(record.windows) == sorted(s.window for s in steps)
        assert record.unique_experts_bound == min(E, record.positions * m)
        for layer in range(engine.info.num_layers):
            ids = {e for s in steps for position in s.topk_ids[layer] for e in position}
            assert record.unique_experts[layer] == len(ids)
            assert all(record.unique_experts[layer] >= s.unique_experts[layer] for s in steps)
    for result in results:
        expected = [sum(s.batch.unique_experts[i] for s in result.steps) / len(result.steps) for i in range(4)]
        assert result.spec.batch_unique_experts_mean == pytest.approx(expected)


# ------------------------------------------------------------------------- join, leave, cancel


def test_requests_join_and_leave_a_running_batch_without_changing_its_output(engine):
    prompts = [p[-200:] for p in heldout_prompts(3)]
    long_req, cancelled_req, short_req = (GenerationRequest(prompt=p, max_new_tokens=n, sampling=GREEDY)
                                          for p, n in zip(prompts, (48, 48, 16), strict=True))
    policy = DraftPolicy(drafter=Drafter.NGRAM, draft_length=2)
    alone = {r: engine.generate(r, policy).token_ids for r in (long_req, cancelled_req, short_req)}

    running = threading.Event()
    committed = []

    def on_long_delta(delta):
        committed.extend(delta.token_ids)
        if len(committed) >= 4:
            running.set()

    # should_stop is polled once per scheduler iteration the request is in (its prefill passes too),
    # so the steps are counted from what it streamed (one delta per step).
    steps = []

    def stop_after_three_steps():
        return len(steps) >= 3

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(engine.generate, long_req, policy, on_delta=on_long_delta)
        assert running.wait(30)
        late = pool.submit(engine.generate, short_req, policy)
        leaving = pool.submit(engine.generate, cancelled_req, policy, should_stop=stop_after_three_steps,
                              on_delta=steps.append)
        results = first.result(), late.result(), leaving.result()
    long_out, short_out, cancelled = results
    assert_same_or_near_tie(engine, long_req.prompt, alone[long_req], long_out.token_ids)
    assert_same_or_near_tie(engine, short_req.prompt, alone[short_req], short_out.token_ids)
    assert cancelled.finish_reason is FinishReason.CANCELLED and len(cancelled.steps) == 3
    assert cancelled.token_ids == alone[cancelled_req][:len(cancelled.token_ids)]
    sizes = [s.batch.batch_size for s in long_out.steps]
    assert sizes[0] == 1 and max(sizes) == 3 and sizes[-1] == 1, sizes  # alone, joined by two, alone again


def test_a_stopped_request_waiting_for_a_slot_never_runs(engine):
    """More callers than slots: the extra one waits; if it is stopped meanwhile it leaves with nothing."""
    small = make_engine(max_batch=1)
    try:
        busy_req = GenerationRequest(prompt="def f(x):\n", max_new_tokens=40, sampling=GREEDY)
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(small.generate, busy_req, DraftPolicy(), on_delta=lambda d: started.set())
            assert started.wait(30)
            waiting = small.generate(GenerationRequest(prompt="import os\n", max_new_tokens=5), DraftPolicy(),
                                     should_stop=lambda: True)
            assert busy.result().completion_tokens == 40
    finally:
        small.close()
    assert waiting.finish_reason is FinishReason.CANCELLED and waiting.completion_tokens == 0 and not waiting.steps


def test_a_failing_caller_callback_fails_only_its_own_request(engine):
    """should_stop or on_delta raising is that caller's error; the batch and the scheduler go on."""
    def broken_stop():
        raise RuntimeError("stop callback broke")

    def broken_delta(delta):
        raise RuntimeError("delta callback broke")

    prompts = heldout_prompts(3)
    request = [GenerationRequest(prompt=p[-200:], max_new_tokens=24, sampling=GREEDY) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        fine = pool.submit(engine.generate, request[0], DraftPolicy())
        bad_stop = pool.submit(engine.generate, request[1], DraftPolicy(), should_stop=broken_stop)
        bad_delta = pool.submit(engine.generate, request[2], DraftPolicy(), on_delta=broken_delta)
        # Timeouts: a scheduler killed by the error would leave every caller waiting forever.
        with pytest.raises(RuntimeError, match="stop callback broke"):
            bad_stop.result(timeout=60)
        with pytest.raises(RuntimeError, match="delta callback broke"):
            bad_delta.result(timeout=60)
        assert fine.result(timeout=60).completion_tokens == 24
    assert engine.generate(request[1], DraftPolicy()).completion_tokens == 24  # the scheduler still serves


def test_a_dropped_engine_is_collected_and_its_scheduler_thread_ends():
    """Nobody called close(): the scheduler thread must not keep the engine (and its caches) alive."""
    import gc
    import weakref

    engine = make_engine(max_batch=2)
    assert engine.generate(GenerationRequest(prompt="def f():", max_new_tokens=3), DraftPolicy()).completion_tokens == 3
    thread, collected = engine._scheduler._thread, weakref.ref(engine)
    del engine
    gc.collect()
    thread.join(10)
    assert collected() is None and not thread.is_alive()
