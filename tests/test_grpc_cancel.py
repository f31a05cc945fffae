"""Cancellation, deadlines, disconnects and the bounded queue, observed on the real engine.

Every long request here is greedy on a prompt the shipped model continues without EOS, so only a
stop can end it early; the seed (unused by greedy sampling) tags each request in the backend log.
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

LONG = 400  # tokens: many seconds of work, never finished in these tests
PROMPT = "def add(a, b):"


def long_request(tag: int, max_new_tokens: int = LONG) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, max_new_tokens=max_new_tokens,
                             sampling=SamplingParams(temperature=0.0, seed=tag))


@pytest.fixture(scope="module")
def tight_server(backend):
    """One worker and no waiting room: a second concurrent generation is refused."""
    s = ServerThread(backend, ServerConfig(port=0, workers=1, max_queue=0))
    yield s
    s.stop()


def test_cancelled_stream_stops_the_engine_within_a_step_and_frees_its_slot(client, backend, server):
    stream = client.stream(long_request(tag=9001))
    first = [next(stream), next(stream)]
    stream.close()  # cancels the RPC
    result = backend.result_for(9001)
    assert result.finish_reason is FinishReason.CANCELLED
    streamed = sum(len(c.token_ids) for c in first)
    assert streamed <= result.completion_tokens < LONG // 4, "the engine kept going after the cancel"
    wait_until(lambda: server.server.runner.in_flight == 0, what="the slot to be freed")


def test_deadline_is_deadline_exceeded_and_stops_the_engine(client, backend, server):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(long_request(tag=9002), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    result = backend.result_for(9002)
    assert result.finish_reason is FinishReason.CANCELLED
    assert result.completion_tokens < LONG
    wait_until(lambda: server.server.runner.in_flight == 0, what="the slot to be freed")


def test_killed_client_process_stops_its_generation(server, backend):
    # A real disconnect: the client process dies mid-stream without cancelling anything.
    script = textwrap.dedent(f"""
        from service.server.client import MoespecClient
        from service.types import GenerationRequest, SamplingParams
        c = MoespecClient({server.address!r})
        req = GenerationRequest(prompt={PROMPT!r}, max_new_tokens={LONG},
                                sampling=SamplingParams(temperature=0.0, seed=9003))
        for chunk in c.stream(req):
            print("chunk", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "chunk\n"
    finally:
        proc.kill()
        proc.wait()
    result = backend.result_for(9003)
    assert result.finish_reason is FinishReason.CANCELLED and result.completion_tokens < LONG


def test_full_queue_is_resource_exhausted_while_other_rpcs_still_answer(tight_server, backend):
    with MoespecClient(tight_server.address) as c:
        busy = c.stream(long_request(tag=9004))
        next(busy)  # the only slot is taken
        with pytest.raises(grpc.RpcError) as e:
            c.generate(long_request(tag=9005, max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not backend.ran(9005)
        assert c.health() == "SERVING" and c.model_info().num_layers > 0 and c.get_policy()
        busy.close()
        wait_until(lambda: tight_server.server.runner.in_flight == 0, what="the slot to be freed")
        assert c.generate(long_request(tag=9006, max_new_tokens=2)).completion_tokens == 2


def test_request_whose_deadline_passes_in_the_queue_never_reaches_the_engine(backend):
    s = ServerThread(backend, ServerConfig(port=0, workers=1, max_queue=4))
    try:
        with MoespecClient(s.address) as c:
            busy = c.stream(long_request(tag=9007))
            next(busy)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                c.generate(long_request(tag=9008, max_new_tokens=2), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 5
            wait_until(lambda: s.server.runner.in_flight == 1, what="the queued request's slot to be freed")
            busy.close()
            wait_until(lambda: s.server.runner.in_flight == 0, what="the running request's slot to be freed")
            assert not backend.ran(9008)
    finally:
        s.stop()
