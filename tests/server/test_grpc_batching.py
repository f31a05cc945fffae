"""Continuous batching through the real gRPC server: concurrent clients share passes, one client's
deadline stops only its own request, and the server admits as many requests as the engine has
batch slots (plus its queue) before RESOURCE_EXHAUSTED."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from service.server.client import MoespecClient
from service.server.server import ServerConfig
from service.types import DraftPolicy, FinishReason, GenerationRequest, SamplingParams
from tests.conftest import RecordingBackend, ServerThread, wait_until
from tests.engine.test_batching import assert_same_or_near_tie
from tests.support.engine_helpers import heldout_prompts, make_engine


def greedy(tag: int) -> SamplingParams:
    """Greedy: the seed changes nothing but tags the request in the backend's log."""
    return SamplingParams(temperature=0, seed=tag)


def test_one_clients_deadline_does_not_disturb_the_others(client, backend, engine):
    normal = [GenerationRequest(prompt=p[-200:], max_new_tokens=24, sampling=greedy(9600 + i))
              for i, p in enumerate(heldout_prompts(4))]
    doomed = GenerationRequest(prompt="def add(a, b):", max_new_tokens=400, sampling=greedy(9699))
    alone = [engine.generate(r, DraftPolicy(policy_id="default")).token_ids for r in normal]
    # Half the time the doomed request takes alone: it cannot finish in a batch, whatever the machine's speed.
    t0 = time.perf_counter()
    engine.generate(doomed, DraftPolicy(policy_id="default"))
    deadline = (time.perf_counter() - t0) / 2
    with ThreadPoolExecutor(5) as pool:
        doomed_call = pool.submit(client.generate, doomed, timeout=deadline)
        replies = list(pool.map(client.generate, normal))
        with pytest.raises(grpc.RpcError) as e:
            doomed_call.result()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stopped = backend.result_for(9699)
    assert stopped.finish_reason is FinishReason.CANCELLED and stopped.completion_tokens < 400
    doomed_passes = {s.batch.pass_id for s in stopped.steps}
    shared = 0
    for request, reply, expected in zip(normal, replies, alone, strict=True):
        assert_same_or_near_tie(engine, request.prompt, expected, reply.token_ids)
        served = backend.result_for(request.sampling.seed)
        assert served.finish_reason is FinishReason.LENGTH
        shared += sum(s.batch.pass_id in doomed_passes for s in served.steps)
    assert shared > 0, "the doomed request never shared a pass with the others"


def test_the_server_runs_as_many_requests_as_batch_slots_then_refuses():
    small = make_engine(max_batch=2)
    recording = RecordingBackend(small)
    server = ServerThread(recording, ServerConfig(port=0, max_queue=0))
    long = [GenerationRequest(prompt="def add(a, b):", max_new_tokens=300, sampling=greedy(s)) for s in (9701, 9702)]
    try:
        assert server.server.runner._capacity == 2  # workers default to the engine's batch slots
        with MoespecClient(server.address) as c:
            streams = [c.stream(r) for r in long]
            for s in streams:  # both running at once: two steps each (a newcomer's first step rides
                next(s)        # in its own prefill pass; from its second on it shares the others' pass)
                next(s)
            with pytest.raises(grpc.RpcError) as e:
                c.generate(GenerationRequest(prompt="x", max_new_tokens=2))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for s in streams:
                s.close()
            wait_until(lambda: server.server.runner.in_flight == 0, what="the slots to be freed")
        both = [recording.result_for(r.sampling.seed) for r in long]
        assert any(step.batch.batch_size == 2 for step in both[0].steps), "the two requests never shared a pass"
    finally:
        server.stop()
        small.close()
