"""The tuner's span intake: with a bearer token only authenticated exports reach the tuner (a real
OpenTelemetry SDK exporter with and without the header, over plaintext and TLS; a raw gRPC call gets
UNAUTHENTICATED), one window keeps a bounded number of requests with the rest counted as dropped, and
`moespec tune` refuses to listen beyond loopback without a token."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.receiver import OtlpTraceReceiver
from tests.support.tls_helpers import self_signed
from tests.support.tuner_fixtures import request_span
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample

TOKEN = "otlp-7c1e"


def export_one_span(endpoint: str, headers: dict | None = None, credentials=None) -> SpanExportResult:
    """One finished span through the real SDK exporter; returns what the exporter reports."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("t").start_span("one").end()
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=credentials is None, credentials=credentials,
                                headers=headers, timeout=5)
    try:
        return exporter.export(memory.get_finished_spans())
    finally:
        exporter.shutdown()
        provider.shutdown()


@pytest.fixture
def delivered():
    batches, event = [], threading.Event()

    def on_spans(spans):
        batches.append(spans)
        event.set()

    return batches, event, on_spans


def test_an_export_with_the_bearer_token_is_delivered(delivered):
    batches, event, on_spans = delivered
    with OtlpTraceReceiver(on_spans=on_spans, bearer_token=TOKEN) as receiver:
        result = export_one_span(receiver.endpoint, headers={"authorization": f"Bearer {TOKEN}"})
        assert result == SpanExportResult.SUCCESS and event.wait(5)
        assert receiver.rejected_exports == 0
    assert [s["name"] for s in batches[0]] == ["one"]


@pytest.mark.parametrize("headers", [None, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}],
                         ids=["no-header", "wrong-token", "no-bearer-scheme"])
def test_an_export_without_the_right_token_is_refused_and_never_delivered(delivered, headers):
    batches, _, on_spans = delivered
    with OtlpTraceReceiver(on_spans=on_spans, bearer_token=TOKEN) as receiver:
        assert export_one_span(receiver.endpoint, headers=headers) == SpanExportResult.FAILURE
        assert receiver.rejected_exports >= 1
    assert batches == []


def test_a_raw_export_without_a_token_gets_unauthenticated():
    with OtlpTraceReceiver(bearer_token=TOKEN) as receiver, grpc.insecure_channel(receiver.address) as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.details()
        stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=5,
                    metadata=(("authorization", f"Bearer {TOKEN}"),))  # accepted


def test_metrics_exports_need_the_token_too():
    with OtlpTraceReceiver(bearer_token=TOKEN) as receiver:
        for headers, accepted in ((None, 0), ({"authorization": f"Bearer {TOKEN}"}, 1)):
            reader = PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=receiver.endpoint, insecure=True, headers=headers, timeout=5),
                export_interval_millis=60_000)
            provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
            provider.get_meter("m").create_counter("c").add(1)
            provider.shutdown()
            assert receiver.metric_exports == accepted
        assert receiver.rejected_exports >= 1


def test_a_tls_receiver_takes_authenticated_tls_exports_only(tmp_path, delivered):
    batches, event, on_spans = delivered
    cert, key = self_signed(tmp_path, "localhost", ip="127.0.0.1")
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with OtlpTraceReceiver(on_spans=on_spans, bearer_token=TOKEN, tls_cert=cert.read_bytes(),
                           tls_key=key.read_bytes()) as receiver:
        assert receiver.endpoint.startswith("https://")
        assert export_one_span(receiver.endpoint, headers={"authorization": f"Bearer {TOKEN}"},
                               credentials=creds) == SpanExportResult.SUCCESS
        assert event.wait(5)
        plain = receiver.endpoint.replace("https://", "http://")
        assert export_one_span(plain, headers={"authorization": f"Bearer {TOKEN}"}) == SpanExportResult.FAILURE
    assert len(batches) == 1


def test_a_window_keeps_a_bounded_number_of_requests_and_counts_the_rest():
    collector = SpanCollector(request_sample, max_window_requests=100)
    collector.watch("s/1")
    for _ in range(5):
        collector.on_spans([request_span("s/1") for _ in range(50)])
    window, traffic = collector.snapshot("s/1"), collector.traffic()
    assert window.requests == 100 and len(window.request_costs) == 100
    assert traffic.dropped_spans == 150 and traffic.request_spans == 250


def test_the_default_window_bound_holds_against_a_flood():
    collector = SpanCollector(request_sample)
    collector.watch("s/1")
    flood = [request_span("s/1") for _ in range(1000)]
    for _ in range(25):  # 25k forged request spans
        collector.on_spans(flood)
    assert collector.snapshot("s/1").requests == 20_000 and collector.traffic().dropped_spans == 5_000


def tune(*extra: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MOESPEC_OTLP_TOKEN"} | (env or {})
    return subprocess.run([sys.executable, "-m", "service.cli", "tune", "--server", "127.0.0.1:1",
                           "--connect-timeout", "0", *extra], capture_output=True, text=True, timeout=120,
                          env=environ, cwd=cwd)


def test_tune_refuses_to_listen_beyond_loopback_without_a_token(tmp_path):
    result = tune("--otlp-listen", "0.0.0.0:0", cwd=tmp_path)
    assert result.returncode == 2 and "--otlp-token-file" in result.stderr and "MOESPEC_OTLP_TOKEN" in result.stderr


def test_tune_listens_beyond_loopback_with_a_token(tmp_path):
    token = tmp_path / "otlp-token"
    token.write_text(TOKEN + "\n")
    for extra, env in ((("--otlp-token-file", str(token)), None), ((), {"MOESPEC_OTLP_TOKEN": TOKEN})):
        result = tune("--otlp-listen", "0.0.0.0:0", *extra, env=env, cwd=tmp_path)
        assert result.returncode == 3, result.stderr  # got past the intake check; the server is not there
        assert "bearer token required" in result.stderr


@pytest.mark.parametrize("with_header", [True, False], ids=["token-in-headers", "no-headers"])
def test_a_real_server_exports_to_a_token_receiver_through_the_standard_headers_variable(with_header):
    """`moespec serve` with OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>: its request spans
    reach a receiver that requires the token; without the variable they are refused, never delivered."""
    from service.server.client import MoespecClient
    from service.types import GenerationRequest
    from tuner.drivers.server_proc import start_server, telemetry_env

    with OtlpTraceReceiver(bearer_token=TOKEN) as receiver:
        env = telemetry_env(receiver.endpoint)
        if with_header:
            env["OTEL_EXPORTER_OTLP_HEADERS"] = f"authorization=Bearer%20{TOKEN}"
        with start_server(env, "admin", ("--threads", "1", "--kernel-threads", "1", "--max-batch", "2")) as server, \
                MoespecClient(server.address) as client:
            client.generate(GenerationRequest(prompt="def f(", max_new_tokens=4), timeout=60)
            if with_header:
                spans = receiver.wait_for(lambda s: any(x["name"].startswith("text_completion") for x in s), 30)
                assert spans and receiver.rejected_exports == 0
            else:
                deadline = time.monotonic() + 30
                while receiver.rejected_exports == 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert receiver.rejected_exports >= 1 and receiver.spans == []


def test_tune_reports_the_exports_it_refused(tmp_path):
    """A Collector with a wrong token shows up in the tuner's own output, not only as missing spans."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "otlp-token"
    token.write_text(TOKEN + "\n")
    environ = {k: v for k, v in os.environ.items() if k != "MOESPEC_OTLP_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "tune", "--server", "127.0.0.1:1",
                             "--connect-timeout", "8", "--otlp-listen", f"127.0.0.1:{port}",
                             "--otlp-token-file", str(token)], stderr=subprocess.PIPE, text=True, env=environ,
                            cwd=tmp_path)
    try:
        first = proc.stderr.readline()
        assert "receiving spans on" in first and "bearer token required" in first, first
        assert export_one_span(f"http://127.0.0.1:{port}", headers={"authorization": "Bearer wrong"}) == \
            SpanExportResult.FAILURE
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3
    assert "refused 1 OTLP exports without the right bearer token" in rest
