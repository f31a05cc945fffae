"""Several steps in one kernel call (`steps_per_call`): plain steps back to back, greedy or sampled, and a
lone greedy request's speculative steps with the draft head's chain at draft temperature 0. The engine
commits exactly what one step per call commits, with one step record per step holding the same drafts,
verdicts and routing, alone and batched, through budgets shorter than a call, EOS inside a call and
streaming; a sampled request's output is its seed's whatever shares its calls (the draws a call did not
use are handed back to its generator); and it really runs several steps per call where nothing stops it
(and one where Python must run between steps)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from service.types import Controller, Drafter, DraftPolicy, FinishReason, GenerationRequest, SamplingParams
from tests.support.engine_helpers import heldout_prompts, make_engine

GREEDY = SamplingParams(temperature=0)
PLAIN = DraftPolicy()
HEAD = DraftPolicy(draft_length=6, draft_temperature=0)  # the draft head's chain, as the draft benchmark's best


class CallCounter:
    """Counts the target's multi-step calls and the steps they ran (wrapping this engine's model only)."""

    def __init__(self, engine):
        self.calls, self.steps = 0, 0
        plain, head = engine.target.decode_steps, engine.target.head_greedy_steps

        def counted_plain(*args, **kwargs):
            picks, routed, seconds = plain(*args, **kwargs)
            self.calls += 1
            self.steps += len(seconds)
            return picks, routed, seconds

        def counted_head(*args, **kwargs):
            ran = head(*args, **kwargs)
            self.calls += 1
            self.steps += len(ran.seconds)
            return ran

        engine.target.decode_steps, engine.target.head_greedy_steps = counted_plain, counted_head

    def take(self) -> tuple[int, int]:
        taken = self.calls, self.steps
        self.calls = self.steps = 0
        return taken


@pytest.fixture(scope="module")
def engines():
    in_calls, one_by_one = make_engine(capture_topk=True), make_engine(capture_topk=True, steps_per_call=1)
    assert in_calls.config.steps_per_call == 8  # the default
    yield in_calls, one_by_one, CallCounter(in_calls)
    in_calls.close()
    one_by_one.close()


def _request(prompt: str, tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=tokens, sampling=kw.pop("sampling", GREEDY), **kw)


def _same_steps(a, b):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
    assert len(a.steps) == len(b.steps) == a.spec.verify_steps == b.spec.verify_steps
    for x, y in zip(a.steps, b.steps, strict=True):
        assert (x.committed, x.drafted, x.accepted) == (y.committed, y.drafted, y.accepted)
        assert x.unique_experts == y.unique_experts and x.topk_ids == y.topk_ids and x.window_ids == y.window_ids
        assert x.batch.unique_experts == y.batch.unique_experts and x.batch.positions == y.batch.positions


@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 9, 40])
def test_steps_in_one_call_commit_what_one_step_per_call_commits(engines, tokens):
    in_calls, one_by_one, counter = engines
    counter.take()
    for prompt in heldout_prompts(3):
        _same_steps(in_calls.generate(_request(prompt, tokens), PLAIN),
                    one_by_one.generate(_request(prompt, tokens), PLAIN))
    calls, steps = counter.take()
    # The first token comes from the step after prefill, with the prompt's prefill in the same
    # iteration: one step alone; the rest run in calls of up to 8.
    assert calls == 3 * -(-(tokens - 1) // 8) if tokens > 2 else calls == 0  # (a budget of 1 left: one step)
    assert steps == (3 * (tokens - 1) if tokens > 2 else 0)


@pytest.mark.parametrize("policy, tokens, search", [(PLAIN, 40, range(11, 30)), (HEAD, 60, range(20, 50))],
                         ids=["plain", "head chain"])
def test_eos_inside_a_call_ends_the_request_at_the_same_token(engines, policy, tokens, search):
    """EOS taken to be a token plain decoding emits inside a later call: both engines stop at it."""
    in_calls, one_by_one, counter = engines
    prompt = heldout_prompts(1)[0]
    plain = one_by_one.generate(_request(prompt, tokens), PLAIN).token_ids
    at = next(i for i in search if plain[i] not in plain[:i])
    saved = in_calls.runtime.eos_id, one_by_one.runtime.eos_id
    try:
        in_calls.runtime.eos_id = one_by_one.runtime.eos_id = plain[at]
        counter.take()
        request = _request(prompt, tokens)
        a, b = in_calls.generate(request, policy), one_by_one.generate(request, policy)
    finally:
        in_calls.runtime.eos_id, one_by_one.runtime.eos_id = saved
    _same_steps(a, b)
    assert a.finish_reason is FinishReason.STOP and a.token_ids == plain[:at + 1]
    calls, steps = counter.take()
    assert calls >= 1
    if policy is PLAIN:
        assert steps == at  # the call that picked EOS ran no step after it (the first step ran alone)


def test_batched_requests_commit_what_they_commit_alone(engines):
    in_calls, one_by_one, counter = engines
    prompts = heldout_prompts(6)
    requests = [_request(p, 12 + 5 * i) for i, p in enumerate(prompts)]
    alone = [one_by_one.generate(r, PLAIN).token_ids for r in requests]
    counter.take()
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: in_calls.generate(r, PLAIN), requests))
    assert [r.token_ids for r in together] == alone
    calls, steps = counter.take()
    assert steps > 2 * calls > 0  # several steps per call, with several requests in the pass


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95, seed=3), SamplingParams(temperature=1.2, top_k=40, seed=4)]


@pytest.mark.parametrize("sampling", SAMPLED, ids=["top-p", "top-k"])
@pytest.mark.parametrize("tokens", [5, 9, 40])
def test_sampled_plain_steps_in_one_call_commit_what_one_step_per_call_commits(engines, sampling, tokens):
    in_calls, one_by_one, counter = engines
    counter.take()
    for prompt in heldout_prompts(2):
        _same_steps(in_calls.generate(_request(prompt, tokens, sampling=sampling), PLAIN),
                    one_by_one.generate(_request(prompt, tokens, sampling=sampling), PLAIN))
    calls, steps = counter.take()
    assert calls == 2 * -(-(tokens - 1) // 8) and steps == 2 * (tokens - 1)


def test_sampled_requests_keep_their_seeds_output_when_a_call_ends_early(engines):
    """Greedy and sampled requests in one batch, EOS taken to be a token one of them emits mid-call: that
    call ends early, the others had drawn uniforms for steps it never ran, and each still commits what
    it commits alone one step per call."""
    in_calls, one_by_one, counter = engines
    prompts = heldout_prompts(4)
    requests = [_request(prompts[0], 40, sampling=SAMPLED[0]), _request(prompts[1], 40, sampling=SAMPLED[1]),
                _request(prompts[2], 40), _request(prompts[3], 40, sampling=SamplingParams(temperature=1.0, seed=9))]
    first = one_by_one.generate(requests[0], PLAIN).token_ids
    at = next(i for i in range(12, 30) if first[i] not in first[:i])
    saved = in_calls.runtime.eos_id, one_by_one.runtime.eos_id
    try:
        in_calls.runtime.eos_id = one_by_one.runtime.eos_id = first[at]
        alone = [one_by_one.generate(r, PLAIN).token_ids for r in requests]
        counter.take()
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: in_calls.generate(r, PLAIN), requests))
    finally:
        in_calls.runtime.eos_id, one_by_one.runtime.eos_id = saved
    assert alone[0] == first[:at + 1]
    assert [r.token_ids for r in together] == alone
    calls, steps = counter.take()
    assert steps > 2 * calls > 0


def test_streamed_deltas_add_up_to_the_output_one_per_step(engines):
    in_calls, _, _ = engines
    deltas = []
    result = in_calls.generate(_request(heldout_prompts(1)[0], 30), PLAIN, on_delta=deltas.append)
    assert "".join(d.text for d in deltas) == result.text
    assert tuple(t for d in deltas for t in d.token_ids) == result.token_ids
    assert [d.step for d in deltas] == list(result.steps)


@pytest.mark.parametrize("case", ["sampled draft", "n-gram drafter", "tree", "sampled request", "stop string",
                                  "adaptive controller"])
def test_steps_that_need_python_between_them_run_one_per_call(engines, case):
    in_calls, _, counter = engines
    prompt = heldout_prompts(1)[0]
    policy = {"sampled draft": DraftPolicy(draft_length=3, draft_temperature=0.8),
              "n-gram drafter": DraftPolicy(drafter=Drafter.NGRAM, draft_length=3),
              "tree": DraftPolicy(draft_length=4, draft_temperature=0, tree_width=2),
              "adaptive controller": DraftPolicy(draft_length=4, draft_temperature=0, controller=Controller.MOESPEC),
              }.get(case, HEAD)
    request = (_request(prompt, 20, sampling=SamplingParams(temperature=0.8, seed=1)) if case == "sampled request"
               else _request(prompt, 20, stop=("never printed",)) if case == "stop string" else _request(prompt, 20))
    counter.take()
    in_calls.generate(request, policy)
    assert counter.take() == (0, 0)


@pytest.mark.parametrize("k", [1, 3, 6, 8])
@pytest.mark.parametrize("tokens", [2, 7, 40])
def test_head_steps_in_one_call_commit_what_one_step_per_call_commits(engines, k, tokens):
    """The draft head's chain at temperature 0: each step's drafts, verdict, routing and commit as the Python
    step computes them (the head's catch-up reads the features the calls wrote, its cache is redone past
    the accepted drafts: a slip in either changes later drafts, and so the records)."""
    in_calls, one_by_one, counter = engines
    policy = DraftPolicy(draft_length=k, draft_temperature=0)
    counter.take()
    for prompt in heldout_prompts(4):
        request = _request(prompt, tokens)
        a, b = in_calls.generate(request, policy), one_by_one.generate(request, policy)
        _same_steps(a, b)
        assert [s.accepted_per_position for s in a.steps] == [s.accepted_per_position for s in b.steps]
        assert [s.planned for s in a.steps] == [s.planned for s in b.steps]
    calls, steps = counter.take()
    if tokens == 40:  # the first step follows the prefill; the rest run in calls while a draft fits the budget
        assert calls >= 4 and steps > calls


def test_head_steps_refuse_what_does_not_fit_before_running(engines):
    in_calls, _, _ = engines
    rt = in_calls.runtime
    args = (rt.head_chain, None, rt.target_cache)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="features must be contiguous float32"):
            rt.target.head_greedy_steps(*args, rt.target_features[:1], 0, [5, 6, 7], 1, 4, 10, None, 2)
        with pytest.raises(ValueError, match="do not fit the caches"):
            rt.target.head_greedy_steps(*args, rt.target_features, 0, [5] * 500, 1, 4, 20, None, 2)
        with pytest.raises(ValueError, match="draft_valid"):
            rt.target.head_greedy_steps(*args, rt.target_features, 0, [5, 6, 7], 0, 4, 10, None, 2)
