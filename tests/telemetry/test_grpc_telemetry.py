"""The servicer drives `otel.api.Telemetry` as documented: one observation per generation, opened
before the engine runs, ended by exactly one finish(result) or fail(error, server_fault), and its
trace id returned to the client. A recording implementation stands in for the real one here; the
real one is tested against an in-memory exporter in the otel tests.
"""

from __future__ import annotations

import contextlib
import threading

import grpc
import pytest

from service.server.client import MoespecClient
from service.server.server import ServerConfig
from service.types import FinishReason, GenerationRequest, InvalidRequest, SamplingParams
from tests.conftest import ServerThread, wait_until

TRACE_ID = "0123456789abcdef0123456789abcdef"


class RecordingObservation:
    trace_id = TRACE_ID

    def __init__(self, log, request, policy):
        self.log, self.request, self.policy = log, request, policy
        self.ended: list[tuple[str, object, bool | None]] = []

    def finish(self, result):
        self.ended.append(("finish", result, None))

    def fail(self, error, server_fault):
        self.ended.append(("fail", error, server_fault))


class RecordingTelemetry:
    def __init__(self):
        self.observations: list[RecordingObservation] = []
        self.open = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def request(self, info, request, policy):
        obs = RecordingObservation(self, request, policy)
        with self._lock:
            self.observations.append(obs)
            self.open += 1
        try:
            yield obs
        finally:
            with self._lock:
                self.open -= 1

    def shutdown(self):
        pass

    def last(self) -> RecordingObservation:
        wait_until(lambda: self.open == 0, what="the observation to close")
        return self.observations[-1]


@pytest.fixture(scope="module")
def observed(backend):
    telemetry = RecordingTelemetry()
    s = ServerThread(backend, ServerConfig(port=0), telemetry=telemetry)
    with MoespecClient(s.address) as c:
        yield c, telemetry
    s.stop()


def test_unary_generation_is_finished_once_with_its_result_and_returns_the_trace_id(observed):
    client, telemetry = observed
    reply = client.generate(GenerationRequest(prompt="a = ", max_new_tokens=3, sampling=SamplingParams(seed=1)))
    obs = telemetry.last()
    assert [kind for kind, _, _ in obs.ended] == ["finish"]
    assert obs.ended[0][1].token_ids == reply.token_ids
    assert obs.policy.policy_id == reply.spec.policy_id and obs.request.max_new_tokens == 3
    assert reply.trace_id == TRACE_ID


def test_stream_final_chunk_carries_the_trace_id(observed):
    client, telemetry = observed
    chunks = list(client.stream(GenerationRequest(prompt="a = ", max_new_tokens=3)))
    assert chunks[-1].reply.trace_id == TRACE_ID
    assert [kind for kind, _, _ in telemetry.last().ended] == ["finish"]


def test_invalid_request_is_failed_as_a_client_fault(observed):
    client, telemetry = observed
    with pytest.raises(grpc.RpcError):
        client.generate(GenerationRequest(prompt="a", max_new_tokens=0))
    (kind, error, server_fault), = telemetry.last().ended
    assert kind == "fail" and isinstance(error, InvalidRequest) and server_fault is False


def test_cancelled_generation_is_finished_with_its_partial_result(observed):
    client, telemetry = observed
    stream = client.stream(GenerationRequest(prompt="def add(a, b):", max_new_tokens=400,
                                             sampling=SamplingParams(temperature=0.0)))
    next(stream)
    stream.close()
    (kind, result, _), = telemetry.last().ended
    assert kind == "finish" and result.finish_reason is FinishReason.CANCELLED


@pytest.fixture(scope="module")
def traced(backend):
    """The real OtelTelemetry and its gRPC server interceptor, spans kept in memory."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel.config import TelemetryConfig
    from otel.setup import build_telemetry_from_config

    exporter = InMemorySpanExporter()
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ({}), backend.info,
                                            extra_span_processors=[SimpleSpanProcessor(exporter)])
    s = ServerThread(backend, ServerConfig(port=0), telemetry=telemetry,
                     interceptors=telemetry.server_interceptors())
    with MoespecClient(s.address) as c:
        yield c, exporter
    s.stop()
    telemetry.shutdown()


def test_real_telemetry_request_span_nests_under_the_grpc_server_span_for_a_stream(traced):
    client, exporter = traced
    exporter.clear()
    final = list(client.stream(GenerationRequest(prompt="a = ", max_new_tokens=3)))[-1].reply
    wait_until(lambda: len([s for s in exporter.get_finished_spans() if s.name.startswith("/moespec")]) == 1,
               what="the server span")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server_span = spans["/moespec.v1.Inference/GenerateStream"]
    request_span = next(s for name, s in spans.items() if name.startswith("text_completion"))
    assert request_span.parent is not None and request_span.parent.span_id == server_span.context.span_id
    assert f"{request_span.context.trace_id:032x}" == final.trace_id


def test_real_telemetry_cancelled_stream_still_stops_the_engine(traced, backend):
    client, _ = traced
    stream = client.stream(GenerationRequest(prompt="def add(a, b):", max_new_tokens=400,
                                             sampling=SamplingParams(temperature=0.0, seed=9101)))
    next(stream)
    stream.close()
    result = backend.result_for(9101)
    assert result.finish_reason is FinishReason.CANCELLED and result.completion_tokens < 100
