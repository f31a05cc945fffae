"""Through the real gRPC server: the instrumentation's server span continues a client's `traceparent`,
the request span is its child, verify spans are the request span's children, and the trace id in
the response is the exported one. Spans arrive at a real OTLP/gRPC receiver."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.receiver import OtlpTraceReceiver
from otel.setup import build_telemetry_from_config
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import convert
from service.server.server import MoespecServer, ServerConfig
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

GENERATE = "/moespec.v1.Inference/Generate"
STREAM = "/moespec.v1.Inference/GenerateStream"


class InstrumentedServer:
    """MoespecServer with the telemetry's interceptors, on its own event loop thread."""

    def __init__(self, backend, telemetry, policy: DraftPolicy):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = MoespecServer(backend, ServerConfig(port=0, initial_policy=policy), telemetry,
                                    interceptors=telemetry.server_interceptors())
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1.0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def stack(backend):
    receiver = OtlpTraceReceiver()
    receiver.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
           "OTEL_BSP_SCHEDULE_DELAY": "20", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ(env), backend.info)
    server = InstrumentedServer(backend, telemetry, DraftPolicy(Drafter.MODEL, 2, policy_id="grpc-test"))
    channel = grpc.insecure_channel(server.server.address)
    yield receiver, pb_grpc.InferenceStub(channel), channel
    channel.close()
    server.stop()
    telemetry.shutdown()
    receiver.stop()


def request_pb(seed: int, max_new_tokens: int = 6) -> pb.GenerateRequest:
    return convert.request_to_pb(GenerationRequest(prompt="def f(x):\n", max_new_tokens=max_new_tokens,
                                                   sampling=SamplingParams(temperature=0, seed=seed)))


def spans_of(receiver, trace_id: str, predicate) -> list[dict]:
    spans = receiver.wait_for(lambda spans: predicate([s for s in spans if s["trace_id"] == trace_id]))
    return [s for s in spans if s["trace_id"] == trace_id]


def has_request_and_server(spans) -> bool:
    return any(s["kind"] == "SERVER" for s in spans) and any(s["name"].startswith("text_completion") for s in spans)


def one(spans, predicate) -> dict:
    (span,) = [s for s in spans if predicate(s)]
    return span


def test_client_traceparent_is_continued_down_to_the_verify_spans(stack, backend):
    receiver, stub, _ = stack
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    reply = stub.Generate(request_pb(seed=101), metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")])
    result = backend.result_for(101)
    assert reply.trace_id == trace_id
    spans = spans_of(receiver, trace_id, lambda s: len(s) >= 2 + len(result.steps))
    server = one(spans, lambda s: s["kind"] == "SERVER")
    assert server["name"] == GENERATE and server["parent_span_id"] == parent_id
    request = one(spans, lambda s: s["name"] == "text_completion target")
    assert request["parent_span_id"] == server["span_id"]
    assert request["attributes"][a.SPEC_POLICY_ID] == "grpc-test"
    assert request["attributes"][a.SPEC_COMMITTED_TOKENS] == reply.spec.committed_tokens == len(reply.token_ids)
    verify = [s for s in spans if s["name"] == "verify"]
    assert len(verify) == len(result.steps) and {s["parent_span_id"] for s in verify} == {request["span_id"]}


def test_without_traceparent_the_response_names_the_exported_trace(stack, backend):
    receiver, stub, _ = stack
    reply = stub.Generate(request_pb(seed=102))
    assert len(reply.trace_id) == 32
    spans = spans_of(receiver, reply.trace_id, has_request_and_server)
    server = one(spans, lambda s: s["kind"] == "SERVER")
    assert server["parent_span_id"] == "" and server["status_code"] == "UNSET"


def test_stream_final_chunk_carries_the_trace_id(stack, backend):
    receiver, stub, _ = stack
    trace_id = secrets.token_hex(16)
    chunks = list(stub.GenerateStream(request_pb(seed=103), metadata=[("traceparent", f"00-{trace_id}-{'1' * 16}-01")]))
    assert chunks[-1].trace_id == trace_id
    spans = spans_of(receiver, trace_id, has_request_and_server)
    assert one(spans, lambda s: s["kind"] == "SERVER")["name"] == STREAM


def test_invalid_argument_is_not_a_server_fault(stack):
    receiver, stub, _ = stack
    trace_id = secrets.token_hex(16)
    bad = pb.GenerateRequest(prompt="x", max_new_tokens=0)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(bad, metadata=[("traceparent", f"00-{trace_id}-{'2' * 16}-01")])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = spans_of(receiver, trace_id, has_request_and_server)
    request = one(spans, lambda s: s["name"].startswith("text_completion"))
    assert request["status_code"] == "UNSET" and request["attributes"][a.ERROR_TYPE] == "InvalidRequest"
    assert one(spans, lambda s: s["kind"] == "SERVER")["status_code"] == "UNSET"


def test_health_checks_are_not_traced(stack):
    receiver, stub, channel = stack
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    reply = stub.Generate(request_pb(seed=104, max_new_tokens=2))
    spans_of(receiver, reply.trace_id, has_request_and_server)  # exported after the health check
    assert not [s for s in receiver.spans if "Health" in s["name"]]


def test_collector_down_requests_succeed_and_the_drop_counter_moves(backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}", "OTEL_BSP_SCHEDULE_DELAY": "20",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "300", "OTEL_METRIC_EXPORT_INTERVAL": "100", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ(env), backend.info)
    server = InstrumentedServer(backend, telemetry, DraftPolicy(Drafter.MODEL, 2, policy_id="dead-collector"))
    try:
        with grpc.insecure_channel(server.server.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            replies = [stub.Generate(request_pb(seed=200 + i, max_new_tokens=4), timeout=60) for i in range(3)]
        deadline = time.monotonic() + 10
        while telemetry.dropped_spans == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
        telemetry.shutdown()
    assert all(len(r.token_ids) == 4 and len(r.trace_id) == 32 for r in replies)
    assert telemetry.dropped_spans > 0
