"""OTLP over http/protobuf reaches /v1/traces and /v1/metrics; the console exporter prints spans."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.receiver import spans_from_request
from otel.setup import build_telemetry_from_config
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams


class OtlpHttpSink:
    """A minimal OTLP/HTTP endpoint: stores each POST body by path, answers 200 with an empty message."""

    def __init__(self):
        self.bodies: dict[str, list[bytes]] = {}
        self.got = threading.Event()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                sink.bodies.setdefault(self.path, []).append(body)
                sink.got.set()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_http_protobuf_exports_the_request_span_to_v1_traces(engine):
    sink = OtlpHttpSink()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "MOESPEC_VERIFY_SPAN_RATIO": "0"}
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ(env), engine.info)
    policy = DraftPolicy(Drafter.NGRAM, 2, policy_id="http")
    request = GenerationRequest(prompt="def f(x):\n", max_new_tokens=4, sampling=SamplingParams(temperature=0))
    try:
        with telemetry.request(engine.info, request, policy) as obs:
            obs.finish(engine.generate(request, policy))
        assert telemetry.force_flush(5000)
    finally:
        telemetry.shutdown()
        sink.close()
    spans = [s for body in sink.bodies["/v1/traces"]
             for s in spans_from_request(ExportTraceServiceRequest.FromString(body))]
    (span,) = spans
    assert span["trace_id"] == obs.trace_id
    assert span["attributes"][a.SPEC_POLICY_ID] == "http"
    assert "/v1/metrics" in sink.bodies  # the final flush of the metric reader
    assert telemetry.dropped_spans == 0


def test_console_exporter_prints_the_request_span_for_debugging(engine, capsys):
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ({"OTEL_TRACES_EXPORTER": "console"}),
                                            engine.info)
    policy = DraftPolicy(Drafter.MODEL, 0, policy_id="console")
    request = GenerationRequest(prompt="x = ", max_new_tokens=2, sampling=SamplingParams(temperature=0))
    try:
        with telemetry.request(engine.info, request, policy) as obs:
            obs.finish(engine.generate(request, policy))
        telemetry.force_flush(5000)
    finally:
        telemetry.shutdown()
    out = capsys.readouterr().out
    assert '"name": "text_completion target"' in out and obs.trace_id in out
