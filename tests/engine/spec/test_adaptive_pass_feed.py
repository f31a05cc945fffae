"""What the scheduler tells the adaptive estimates about each pass, through `Engine.generate`: a pass
right after a prefill, or after a step in which a request finished, is marked disturbed (the
pass-cost fit skips it); the steady passes between are not."""

from __future__ import annotations

import threading
import time

import pytest

from service.types import Controller, Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import heldout_prompts, make_engine

# The rule held to plain: every pass has one position per request, so positions = requests in the pass.
HELD_PLAIN = DraftPolicy(Drafter.NGRAM, 4, controller=Controller.MOESPEC, cost_weight=100)


@pytest.fixture()
def engine_and_passes():
    engine = make_engine()
    passes: list[tuple[int, bool]] = []  # (positions, disturbed) of every pass the estimates heard
    observe = engine.runtime.adaptive.observe_pass

    def spy(positions, union, seconds, sampling_seconds=0.0, sampled_rows=0, plain=False, disturbed=False):
        passes.append((positions, disturbed))
        observe(positions, union, seconds, sampling_seconds, sampled_rows, plain=plain, disturbed=disturbed)

    engine.runtime.adaptive.observe_pass = spy
    yield engine, passes
    engine.close()


def request(prompt: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=tokens, sampling=SamplingParams(temperature=0))


def test_a_request_alone_disturbs_only_the_pass_after_its_prefill(engine_and_passes):
    engine, passes = engine_and_passes
    result = engine.generate(request(heldout_prompts(1)[0], 12), HELD_PLAIN)
    assert [d for _, d in passes] == [True] + [False] * (len(result.steps) - 1)


def test_the_pass_after_a_request_finished_is_disturbed_and_the_next_is_not(engine_and_passes):
    engine, passes = engine_and_passes
    short, long = heldout_prompts(2)
    joined = threading.Event()
    threads = [threading.Thread(target=engine.generate, args=(request(short, 3), HELD_PLAIN))]

    def join_the_short_one(_delta) -> None:
        """At the long request's first step (on the scheduler thread): the short request is queued
        before the next step, so the two share passes whatever the threads' timing."""
        if joined.is_set():
            return
        joined.set()
        threads[0].start()
        deadline = time.monotonic() + 30
        while not engine._scheduler._waiting and time.monotonic() < deadline:
            time.sleep(0.001)

    # (no probe: under 16 plain steps)
    result = engine.generate(request(long, 14), HELD_PLAIN, on_delta=join_the_short_one)
    threads[0].join()
    assert len(result.steps) == 14
    # The long request runs alone once the short one finished: no prefill runs then (nobody waits).
    last_pair = max(i for i, (n, _) in enumerate(passes) if n == 2)
    alone = passes[last_pair + 1:]
    assert len(alone) >= 3 and all(n == 1 for n, _ in alone)
    assert alone[0][1] and not any(d for _, d in alone[1:])


def test_a_lookup_that_found_nothing_reaches_the_rule(engine_and_passes):
    """The scheduler tells the rule of a step that asked for drafts and verified none: the n-gram
    lookups the rule's kind has seen include the empty ones, not only those that found drafts."""
    engine, _ = engine_and_passes
    eager = DraftPolicy(Drafter.NGRAM, 4, controller=Controller.MOESPEC, cost_weight=1e-3)  # drafts nearly always
    result = engine.generate(request(heldout_prompts(1)[0], 24), eager)
    found = engine.runtime.adaptive.lookup_found[False]  # greedy requests'
    assert result.spec.empty_drafts > 0
    assert found.trials - found.hits > 0.5  # at least one empty lookup counted
    assert found.hits > 0.5  # and the ones that found drafts
