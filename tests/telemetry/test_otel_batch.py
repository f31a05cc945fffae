"""Batch passes in telemetry: one `verify_batch` span per pass, received by a real OTLP receiver,
linked to exactly the request spans the pass served, its attributes recomputed from the requests'
step records; the batch-union histograms count each pass once; a pass some request never reports
is still emitted (bounded wait, flush at shutdown)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel import attributes as a
from otel.batch import BatchPassReporter
from otel.config import TelemetryConfig
from otel.receiver import OtlpTraceReceiver
from otel.setup import build_telemetry_from_config
from service.types import BatchPassRecord, Drafter, DraftPolicy, GenerationRequest, SamplingParams, StepRecord
from tests.support.engine_helpers import heldout_prompts

POLICIES = [DraftPolicy(policy_id="plain"), DraftPolicy(Drafter.NGRAM, 4, policy_id="ngram-4"),
            DraftPolicy(Drafter.MODEL, 2, 0.5, policy_id="model-2")]


def traced_requests(engine, telemetry, count: int, policies: list[DraftPolicy] = POLICIES):
    """`count` concurrent requests (policies in turn), each inside its own request span ->
    [(result, its request observation)]."""
    def one(i: int):
        policy = policies[i % len(policies)]
        request = GenerationRequest(prompt=heldout_prompts(count)[i][-160:], max_new_tokens=12,
                                    sampling=SamplingParams(temperature=0.7, seed=i))
        with telemetry.request(engine.info, request, policy) as obs:
            result = engine.generate(request, policy)
            obs.finish(result)
        return result, obs

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def receiver_telemetry(rx: OtlpTraceReceiver, engine, reader: InMemoryMetricReader, seed: int):
    """Telemetry that sends every verify span (ratio 1, short batching delay) to `rx` and its metrics
    to `reader`."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_BSP_SCHEDULE_DELAY": "20", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    return build_telemetry_from_config(TelemetryConfig.from_environ(environ), engine.info, seed=seed,
                                       extra_metric_readers=[reader])


@pytest.fixture(scope="module")
def exported(engine):
    reader = InMemoryMetricReader()
    with OtlpTraceReceiver() as rx:
        telemetry = receiver_telemetry(rx, engine, reader, seed=7)
        try:
            runs = traced_requests(engine, telemetry, 6)
            passes = {s.batch.pass_id for result, _ in runs for s in result.steps}
            spans = rx.wait_for(lambda got: sum(s["name"] == a.VERIFY_BATCH_SPAN_NAME for s in got) >= len(passes)
                                and sum(s["name"].startswith("text_completion") for s in got) >= len(runs))
            request_spans = {s["trace_id"]: s for s in spans if s["name"].startswith("text_completion")}
        finally:
            metrics = reader.get_metrics_data()
            telemetry.shutdown()
    return runs, [s for s in spans if s["name"] == a.VERIFY_BATCH_SPAN_NAME], request_spans, metrics


def test_each_pass_has_one_verify_batch_span_linked_to_the_requests_it_served(exported):
    runs, batch_spans, request_spans, _ = exported
    served: dict[int, list] = {}  # pass id -> (step, request span id) of every request in it
    for result, obs in runs:
        span_id = request_spans[obs.trace_id]["span_id"]
        for step in result.steps:
            served.setdefault(step.batch.pass_id, []).append((step, span_id))
    by_pass = {s["attributes"][a.BATCH_PASS_ID]: s for s in batch_spans}
    assert set(by_pass) == set(served) and len(batch_spans) == len(served)
    assert max(len(v) for v in served.values()) >= 3, "the requests never shared a pass"
    for pass_id, steps in served.items():
        span, record = by_pass[pass_id], steps[0][0].batch
        attrs = span["attributes"]
        assert set(attrs) == set(a.VERIFY_BATCH_SPAN_KEYS)
        assert span["parent_span_id"] == ""  # its own trace: a pass belongs to no single request
        assert {link["span_id"] for link in span["links"]} == {span_id for _, span_id in steps}
        assert attrs[a.BATCH_SIZE] == len(steps)
        assert attrs[a.BATCH_POSITIONS] == sum(s.window for s, _ in steps)
        assert sorted(attrs[a.BATCH_WINDOWS]) == sorted(s.window for s, _ in steps)
        union = attrs[a.MOE_BATCH_UNIQUE_EXPERTS]
        assert union == record.unique_experts
        assert all(u >= s.unique_experts[i] for s, _ in steps for i, u in enumerate(union))
        assert span["end_ns"] - span["start_ns"] == pytest.approx(
            (record.draft_seconds + record.verify_seconds) * 1e9, abs=2)


def test_request_spans_carry_the_mean_batch_union_of_their_steps(exported):
    runs, _, request_spans, _ = exported
    for result, obs in runs:
        steps = result.steps
        expected = [sum(s.batch.unique_experts[i] for s in steps) / len(steps) for i in range(4)]
        got = request_spans[obs.trace_id]["attributes"][a.MOE_BATCH_UNIQUE_EXPERTS_MEAN]
        assert got == pytest.approx(expected, rel=1e-12)


def test_batch_union_histograms_count_every_pass_once(exported):
    runs, _, _, metrics = exported
    records = {s.batch.pass_id: s.batch for result, _ in runs for s in result.steps}
    points = {}
    for rm in metrics.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    (size,) = points[a.BATCH_SIZE_METRIC.name]
    assert size.count == len(records) and size.sum == sum(r.batch_size for r in records.values())
    per_layer = {dict(p.attributes)[a.MOE_LAYER]: p for p in points[a.BATCH_UNIQUE_EXPERTS.name]}
    assert sorted(per_layer) == [0, 1, 2, 3]
    for layer, point in per_layer.items():
        assert point.count == len(records)
        assert point.sum == sum(r.unique_experts[layer] for r in records.values())


def _step_in(record: BatchPassRecord) -> StepRecord:
    return StepRecord(drafter=Drafter.MODEL, draft_length=0, draft_temperature=1.0, policy_id="p", drafted=0,
                      accepted=0, committed=1, accepted_per_position=(), window=1, unique_experts=(8,),
                      shared_experts=1, unique_experts_bound=8, draft_seconds=0.0, verify_seconds=0.01,
                      decode_step_equivalents=1.0, batch=record)


def test_a_pass_whose_requests_never_all_report_is_still_emitted():
    """The third request of every pass failed: its passes wait, leave on overflow or at flush, with two links."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    reporter = BatchPassReporter(tracer, 1.0, random.Random(0), max_pending=3)
    records = [BatchPassRecord(pass_id=i, batch_size=3, positions=3, windows=(1, 1, 1), unique_experts=(20,),
                               unique_experts_bound=24, draft_seconds=0.0, verify_seconds=0.01,
                               start_time_ns=1_000_000 * (i + 1)) for i in range(4)]
    first, second = (tracer.start_span(f"request {i}") for i in range(2))
    assert reporter.report(first.get_span_context(), [_step_in(r) for r in records[:3]]) == 0
    assert not exporter.get_finished_spans() and reporter.pending == 3
    # A fourth pass waiting, room for three: the oldest leaves at once with the two links it has.
    assert reporter.report(second.get_span_context(), [_step_in(r) for r in records]) == 1
    (oldest,) = exporter.get_finished_spans()
    assert oldest.attributes[a.BATCH_PASS_ID] == 0
    assert {link.context.span_id for link in oldest.links} == {s.get_span_context().span_id for s in (first, second)}
    assert oldest.start_time == records[0].start_time_ns and oldest.end_time == records[0].end_time_ns
    assert reporter.flush() == 3 and reporter.pending == 0
    assert sorted(s.attributes[a.BATCH_PASS_ID] for s in exporter.get_finished_spans()) == [0, 1, 2, 3]
