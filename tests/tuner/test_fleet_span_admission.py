"""The tuner's span admission (tuner/span_admission.py): spans of a replica the tuner does not
measure, and spans with impossible aggregates, never enter a trial window; each is counted by
reason, as a real SDK counter and in the log. Spans travel the real way: an OpenTelemetry SDK exporter per sender, over
OTLP/gRPC into the tuner's receiver, into the collector the tuner measures with."""

from __future__ import annotations

import math

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel import attributes as attr
from otel.receiver import OtlpTraceReceiver
from tests.support.real_backends import wait_until
from tests.support.tuner_fixtures import request_span
from tuner.measurement.collector import SpanCollector
from tuner.measurement.span_admission import DropReason, SpanAdmission
from tuner.measurement.spans import request_sample


def sender(endpoint: str, instance: str | None) -> TracerProvider:
    resource = {"service.name": "moespec"} | ({attr.RESOURCE_SERVICE_INSTANCE_ID: instance} if instance else {})
    provider = TracerProvider(resource=Resource(resource), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider


def send(provider: TracerProvider, span: dict) -> None:
    provider.get_tracer("moespec").start_span(span["name"], attributes=span["attributes"]).end()


def dropped_metric(reader: InMemoryMetricReader) -> dict[str, int]:
    out: dict[str, int] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == attr.TUNER_SPANS_DROPPED.name:
                    for p in m.data.data_points:
                        out[p.attributes[attr.TUNER_DROP_REASON]] = p.value
    return out


@pytest.fixture
def intake_rig():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    lines: list[str] = []
    intake = SpanAdmission("replica-a", lines.append, meter, study="s")
    collector = SpanCollector(request_sample, admit=intake.admit)
    with OtlpTraceReceiver(on_spans=collector.on_spans) as receiver:
        yield intake, collector, receiver, reader, lines


def test_a_foreign_instance_span_with_the_watched_policy_id_is_ignored_and_counted(intake_rig):
    intake, collector, receiver, reader, lines = intake_rig
    collector.watch("s/3")
    mine, theirs, anonymous = (sender(receiver.endpoint, i) for i in ("replica-a", "replica-b", None))
    try:
        for _ in range(3):
            send(theirs, request_span("s/3", committed=1000, steps=1000, verify_seconds=0.001))
        send(anonymous, request_span("s/3"))
        send(mine, request_span("s/3", steps=10, committed=20, verify_seconds=0.03, draft_seconds=0.01))
        wait_until(lambda: collector.snapshot("s/3").requests >= 1 and sum(intake.dropped().values()) >= 4, 10)
    finally:
        for p in (mine, theirs, anonymous):
            p.shutdown()
    window = collector.snapshot("s/3")
    assert (window.requests, window.committed, window.steps) == (1, 20, 10)  # replica-a's span only
    assert window.seconds_per_token == pytest.approx(0.04 / 20)
    assert intake.dropped() == {"foreign_instance": 4}
    assert dropped_metric(reader) == {"foreign_instance": 4}
    assert lines == ["span dropped (foreign_instance, 1 so far): policy s/3: instance replica-b, measuring replica-a"]
    assert collector.traffic().request_spans == 1  # refused spans are not traffic either


IMPOSSIBLE = [
    (dict(verify_seconds=-0.5), DropReason.NEGATIVE_SECONDS),
    (dict(draft_seconds=-1e-9), DropReason.NEGATIVE_SECONDS),
    (dict(verify_seconds=math.nan), DropReason.NON_FINITE_SECONDS),
    (dict(verify_seconds=math.inf), DropReason.NON_FINITE_SECONDS),
    (dict(draft_seconds=-math.inf), DropReason.NON_FINITE_SECONDS),
    (dict(steps=-1), DropReason.NEGATIVE_COUNT),
    (dict(committed=-5), DropReason.NEGATIVE_COUNT),
    (dict(drafted=5, accepted=6), DropReason.ACCEPTED_OVER_DRAFTED),
    # 1,000,128 tokens from 10 steps that accepted 10 drafts: at most 20 could be committed
    (dict(steps=10, accepted=10, committed=1_000_128), DropReason.COMMITTED_OVER_STEPS),
    (dict(steps=10, accepted=10, committed=21), DropReason.COMMITTED_OVER_STEPS),
]


def test_impossible_aggregates_are_dropped_counted_and_logged_and_never_reach_the_window(intake_rig):
    intake, collector, receiver, reader, lines = intake_rig
    collector.watch("s/7")
    mine = sender(receiver.endpoint, "replica-a")
    try:
        for overrides, _ in IMPOSSIBLE:
            send(mine, request_span("s/7", **overrides))
        # the limit itself is possible: every step committed its accepted drafts plus one token
        send(mine, request_span("s/7", steps=10, accepted=10, committed=20, drafted=30))
        wait_until(lambda: collector.snapshot("s/7").requests >= 1
                   and sum(intake.dropped().values()) >= len(IMPOSSIBLE), 10)
    finally:
        mine.shutdown()
    window = collector.snapshot("s/7")
    assert (window.requests, window.committed) == (1, 20)
    assert math.isfinite(window.seconds_per_token) and window.seconds_per_token > 0
    expected: dict[str, int] = {}
    for _, reason in IMPOSSIBLE:
        expected[reason.value] = expected.get(reason.value, 0) + 1
    assert intake.dropped() == expected
    assert dropped_metric(reader) == expected
    # one log line for the first drop of each reason (then at 10, 100, ... of it)
    assert sorted(line.split(" ")[2].strip("(,") for line in lines) == sorted(expected)


def test_without_an_instance_id_to_expect_every_replica_is_admitted():
    """Negative control: a server that reports no instance id (one from before the field) keeps the
    old behaviour, so the foreign-instance test above fails for the filter, not for the transport."""
    intake = SpanAdmission("")
    collector = SpanCollector(request_sample, admit=intake.admit)
    collector.watch("s/1")
    for instance in ("replica-a", "replica-b"):
        span = request_span("s/1") | {"resource": {attr.RESOURCE_SERVICE_INSTANCE_ID: instance}}
        collector.on_spans([span])
    assert collector.snapshot("s/1").requests == 2 and intake.dropped() == {}


def test_the_intake_follows_a_restarted_replica_to_its_new_instance_id():
    lines: list[str] = []
    intake = SpanAdmission("old", lines.append)
    span = request_span("s/1") | {"resource": {attr.RESOURCE_SERVICE_INSTANCE_ID: "new"}}
    assert not intake.admit(request_sample(span))
    intake.expect("new")
    assert intake.admit(request_sample(span)) and lines[-1] == "spans counted from instance new"
