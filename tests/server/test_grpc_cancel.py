"""Cancellation, deadlines, disconnects and the bounded queue, observed on the real engine.

Every request here is held between two engine steps (tests/engine_helpers.HoldingBackend) until the
event under test has happened, so it is in flight by construction, not by timing; the seed (unused
by greedy sampling) tags each request. Released, a stopped request must end at once: it ran exactly
the steps before the hold, not one more ("stops within one step", checked as one step).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from service.server.client import MoespecClient
from service.server.server import ServerConfig
from service.types import FinishReason, GenerationRequest, SamplingParams
from tests.conftest import ServerThread, wait_until
from tests.support.engine_helpers import Hold, HoldingBackend

LONG = 400  # tokens: never reached, every request here is held in flight and stopped
PROMPT = "def add(a, b):"
HELD_STEPS = 2  # steps a held request completes before it waits for the test


def long_request(tag: int, max_new_tokens: int = LONG) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, max_new_tokens=max_new_tokens,
                             sampling=SamplingParams(temperature=0.0, seed=tag))


@pytest.fixture(scope="module")
def step_engine():
    """The engine polls its requests' stops before every step only when each call runs one step: several
    greedy steps in one call are polled once (tests/engine/test_steps_in_one_call.py tests that)."""
    from service.engine import Engine, EngineConfig

    e = Engine(EngineConfig(threads=1, steps_per_call=1))
    yield e
    e.close()


@pytest.fixture(scope="module")
def holding(step_engine) -> HoldingBackend:
    return HoldingBackend(step_engine)


@pytest.fixture(scope="module")
def held_server(holding):
    s = ServerThread(holding, ServerConfig(port=0, max_queue=32))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tight_server(holding):
    """One worker and no waiting room: a second concurrent generation is refused."""
    s = ServerThread(holding, ServerConfig(port=0, workers=1, max_queue=0))
    yield s
    s.stop()


def stop_while_held(hold: Hold) -> None:
    """The server has asked the held request to stop: let the engine go on to its next poll."""
    wait_until(hold.should_stop, what="the server to ask the engine to stop")
    hold.release()


def assert_stopped_at_the_held_step(result, hold: Hold) -> None:
    """The stop was visible at the engine's next poll: not one step more ran."""
    assert result.finish_reason is FinishReason.CANCELLED
    assert len(result.steps) == hold.after_steps
    assert result.completion_tokens == sum(s.committed for s in result.steps)


def test_cancelled_stream_stops_the_engine_at_its_next_step_and_frees_its_slot(holding, held_server):
    hold = holding.hold(seed=9001, after_steps=HELD_STEPS)
    with MoespecClient(held_server.address) as c:
        stream = c.stream(long_request(tag=9001))
        first = next(stream)
        assert hold.reached.wait(30)  # in flight, by construction
        stream.close()  # cancels the RPC
        stop_while_held(hold)
        result = holding.result_for(9001)
    assert_stopped_at_the_held_step(result, hold)
    assert len(first.token_ids) <= result.completion_tokens
    wait_until(lambda: held_server.server.runner.in_flight == 0, what="the slot to be freed")


def test_deadline_is_deadline_exceeded_and_stops_the_engine(holding, held_server):
    # Held before its first step: however slow the machine, the deadline passes inside the engine.
    hold = holding.hold(seed=9002, after_steps=0)
    with MoespecClient(held_server.address) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(long_request(tag=9002), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert hold.reached.wait(30)
    stop_while_held(hold)
    assert_stopped_at_the_held_step(holding.result_for(9002), hold)
    wait_until(lambda: held_server.server.runner.in_flight == 0, what="the slot to be freed")


def test_killed_client_process_stops_its_generation(holding, held_server):
    # A real disconnect: the client process dies mid-stream without cancelling anything.
    hold = holding.hold(seed=9003, after_steps=HELD_STEPS)
    script = textwrap.dedent(f"""
        from service.server.client import MoespecClient
        from service.types import GenerationRequest, SamplingParams
        c = MoespecClient({held_server.address!r})
        req = GenerationRequest(prompt={PROMPT!r}, max_new_tokens={LONG},
                                sampling=SamplingParams(temperature=0.0, seed=9003))
        for chunk in c.stream(req):
            print("chunk", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "chunk\n"
        assert hold.reached.wait(30)
    finally:
        proc.kill()
        proc.wait()
    stop_while_held(hold)
    assert_stopped_at_the_held_step(holding.result_for(9003), hold)


def test_full_queue_is_resource_exhausted_while_other_rpcs_still_answer(tight_server, holding):
    hold = holding.hold(seed=9004)
    with MoespecClient(tight_server.address) as c:
        busy = c.stream(long_request(tag=9004))
        next(busy)
        assert hold.reached.wait(30)  # the only slot is taken, by construction
        with pytest.raises(grpc.RpcError) as e:
            c.generate(long_request(tag=9005, max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not holding.ran(9005)
        assert c.health() == "SERVING" and c.model_info().num_layers > 0 and c.get_policy()
        busy.close()
        stop_while_held(hold)
        wait_until(lambda: tight_server.server.runner.in_flight == 0, what="the slot to be freed")
        assert c.generate(long_request(tag=9006, max_new_tokens=2)).completion_tokens == 2


def test_request_whose_deadline_passes_in_the_queue_never_reaches_the_engine(holding):
    s = ServerThread(holding, ServerConfig(port=0, workers=1, max_queue=4))
    hold = holding.hold(seed=9007)
    try:
        with MoespecClient(s.address) as c:
            busy = c.stream(long_request(tag=9007))
            next(busy)
            assert hold.reached.wait(30)  # the only worker is busy until the test says otherwise
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                c.generate(long_request(tag=9008, max_new_tokens=2), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 5
            wait_until(lambda: s.server.runner.in_flight == 1, what="the queued request's slot to be freed")
            busy.close()
            stop_while_held(hold)
            wait_until(lambda: s.server.runner.in_flight == 0, what="the running request's slot to be freed")
            assert not holding.ran(9008)
    finally:
        hold.release()
        s.stop()
