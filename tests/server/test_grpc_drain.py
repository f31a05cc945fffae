"""SIGTERM drain of a real `moespec serve` process, seen by real gRPC clients on fresh connections:
during the grace period the port still answers (health NOT_SERVING, model info), new generations
are refused UNAVAILABLE with the reason; at its end the stream in flight gets its final chunk with
finish_reason "cancelled", the process exits 0 and logs no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.engine.model.weights import DEFAULT_DRAFT_DIR
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc

HEALTH_NAMES = ("", "moespec.v1.Inference", "moespec.v1.PolicyAdmin")  # as the proto documents them
GRACE_SECONDS = 3.0
LONG_GENERATION = 480
# Slow on purpose, so the generations outlast the grace period whatever the machine's speed: the
# dense draft model drafting 8 near-uniform tokens (the highest draft temperature) that are almost
# never accepted, so every committed token pays 8 draft steps and a nine-position verify pass; and
# sixteen such generations share the batch, on one kernel thread. In-process on the fastest machine
# seen, eight on two kernel threads took 3.3-3.6 s, about the time to the grace period's end; sixteen
# on one took 9.2 s.
IN_FLIGHT = 16
SLOW_POLICY = ["--draft-model", str(DEFAULT_DRAFT_DIR), "--drafter", "model", "--draft-length", "8",
               "--draft-temperature", "2.0"]


@pytest.fixture
def serving(tmp_path):
    log = (tmp_path / "serve.stderr").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--threads", "1", "--kernel-threads", "1",
         "--grace", str(GRACE_SECONDS), "--log-level", "INFO", *SLOW_POLICY],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("moespec serving on "):
            log.seek(0)
            pytest.fail(f"server did not start: {line!r}\n{log.read()}")
        yield proc, line.split()[-1], log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def fresh_health_check(address: str, service: str) -> int:
    """A new connection each time, as a load balancer's probe makes."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_sigterm_drains_on_an_open_port_and_ends_the_stream_with_cancelled(serving):
    proc, address, log = serving
    NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(address) as channel:
        inference = pb_grpc.InferenceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        assert fresh_health_check(address, "") == health_pb2.HealthCheckResponse.SERVING
        request = pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=LONG_GENERATION,
                                     sampling=pb.SamplingParams(temperature=0.0))
        stream = inference.GenerateStream(request, timeout=120)
        chunks = [next(stream)]  # in flight
        unary: list = []
        unary_calls = [threading.Thread(target=lambda: unary.append(inference.Generate(request, timeout=120)))
                       for _ in range(IN_FLIGHT - 1)]
        for call in unary_calls:
            call.start()
        time.sleep(0.5)  # the unary calls reach the engine (their generations take seconds)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)  # well past the moment the old server closed its port (~60 ms)

        # During the grace period, on new connections:
        assert {name: fresh_health_check(address, name) for name in HEALTH_NAMES} == dict.fromkeys(HEALTH_NAMES,
                                                                                                 NOT_SERVING)
        with grpc.insecure_channel(address) as fresh:
            stub = pb_grpc.InferenceStub(fresh)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).max_context > 0
            for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
                with pytest.raises(grpc.RpcError) as refused:
                    call(pb.GenerateRequest(prompt="x", max_new_tokens=1), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in refused.value.details()
        assert time.monotonic() - signalled < GRACE_SECONDS, "the checks above ran after the grace period"

        chunks += list(stream)  # ends without an error status
        for call in unary_calls:
            call.join(30)
    final = chunks[-1]
    assert final.finish_reason == "cancelled"
    assert all(c.finish_reason == "" for c in chunks[:-1])
    streamed = [t for c in chunks for t in c.token_ids]
    assert 0 < final.completion_tokens == len(streamed) < LONG_GENERATION
    assert final.spec.verify_steps > 0 and final.max_new_tokens == LONG_GENERATION
    assert time.monotonic() - signalled >= GRACE_SECONDS - 0.2  # it ran until the grace period ended
    assert len(unary) == IN_FLIGHT - 1  # the unary calls in flight answer too, with what they generated
    for response in unary:
        assert response.finish_reason == "cancelled" and 0 < response.completion_tokens < LONG_GENERATION

    assert proc.wait(timeout=30) == 0
    log.seek(0)
    stderr = log.read()
    assert "Traceback" not in stderr, stderr
    assert "grace period" in stderr and f"stopping {IN_FLIGHT} generation" in stderr  # the operator is told why


def test_sigterm_with_nothing_in_flight_exits_at_once(serving):
    proc, address, _ = serving
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - start < GRACE_SECONDS  # the grace period is an upper bound, not a wait
