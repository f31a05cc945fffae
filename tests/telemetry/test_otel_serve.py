"""`moespec serve` as a real process: telemetry flags reach the exporter, a client's traceparent is
continued, and SIGTERM flushes the last request's spans (the batch delay here is a minute, so only the
shutdown flush can deliver them)."""

from __future__ import annotations

import secrets
import subprocess

import grpc
import pytest

from otel import attributes as a
from otel.receiver import OtlpTraceReceiver
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import convert
from service.types import GenerationRequest, SamplingParams
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server

TOKEN = "otel-serve-test"


def test_serve_help_lists_the_telemetry_flags():
    out = subprocess.run([*MOESPEC, "serve", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--otel-endpoint", "--otel-protocol", "--verify-span-ratio", "--prometheus-port", "--otel-disabled"):
        assert flag in out.stdout
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in out.stdout


def test_a_bad_telemetry_flag_exits_2_with_one_line():
    out = subprocess.run([*MOESPEC, "serve", "--port", "0", "--verify-span-ratio", "2"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "MOESPEC_VERIFY_SPAN_RATIO" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def receiver():
    with OtlpTraceReceiver() as rx:
        yield rx


def test_serve_continues_the_client_trace_and_flushes_on_sigterm(receiver):
    args = ("--threads", "1", "--draft-length", "2", "--otel-endpoint", receiver.endpoint,
            "--otel-metrics-exporter", "none", "--otel-bsp-schedule-delay", "60000", "--verify-span-ratio", "1")
    server = start_server({}, TOKEN, args)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    try:
        with grpc.insecure_channel(server.address) as channel:
            request = GenerationRequest(prompt="def f(x):\n", max_new_tokens=6, sampling=SamplingParams(temperature=0))
            reply = pb_grpc.InferenceStub(channel).Generate(
                convert.request_to_pb(request), metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60)
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log_tail()
    assert reply.trace_id == trace_id
    spans = [s for s in receiver.wait_for(lambda got: any(s["trace_id"] == trace_id for s in got), timeout=5)
             if s["trace_id"] == trace_id]
    by_kind = {s["kind"]: s for s in spans if s["name"] != "verify"}
    assert by_kind["SERVER"]["parent_span_id"] == parent
    assert by_kind["INTERNAL"]["parent_span_id"] == by_kind["SERVER"]["span_id"]
    request_span = by_kind["INTERNAL"]
    assert request_span["attributes"][a.SPEC_DRAFT_LENGTH] == 2
    assert request_span["attributes"][a.SPEC_COMMITTED_TOKENS] == len(reply.token_ids)
    assert len([s for s in spans if s["name"] == "verify"]) == reply.spec.verify_steps
    assert request_span["resource"][a.RESOURCE_BACKEND] == "torch"
