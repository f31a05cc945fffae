"""Metrics of real engine requests: names, advised buckets, per-layer series, counts that match the steps,
and the optional Prometheus scrape endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.metrics import unique_expert_buckets
from otel.setup import build_telemetry_from_config
from service.types import Controller, Drafter, DraftPolicy, GenerationRequest, SamplingParams

POLICY = DraftPolicy(Drafter.MODEL, 3, 0.5, policy_id="m3")


def generate(engine, telemetry, policy=POLICY, max_new_tokens=20):
    request = GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=max_new_tokens,
                                sampling=SamplingParams(temperature=0))
    with telemetry.request(engine.info, request, policy) as obs:
        result = engine.generate(request, policy)
        obs.finish(result)
    return result


def collect(reader: InMemoryMetricReader) -> dict:
    """name -> list of data points."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


@pytest.fixture(scope="module")
def recorded(engine):
    reader = InMemoryMetricReader()
    telemetry = build_telemetry_from_config(TelemetryConfig(), engine.info, extra_metric_readers=[reader])
    results = [generate(engine, telemetry), generate(engine, telemetry, DraftPolicy(Drafter.NGRAM, 2, policy_id="n2"))]
    points = collect(reader)
    telemetry.shutdown()
    return results, points


def test_every_declared_metric_is_emitted(recorded):
    _, points = recorded
    assert set(points) == {spec.name for spec in a.METRICS}


# The bucket boundaries the GenAI semantic conventions say these histograms SHOULD use, copied from
# the conventions (open-telemetry/semantic-conventions, docs/gen-ai/gen-ai-metrics.md, "Generative AI
# model server metrics": "This metric SHOULD be specified with [ExplicitBucketBoundaries] of [...]"),
# not from otel/attributes.py, so a wrong list there fails here.
SEMCONV_BUCKETS = {
    "gen_ai.server.request.duration": (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                                       40.96, 81.92),
    "gen_ai.server.time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                          5.0, 7.5, 10.0),
    "gen_ai.server.time_per_output_token": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
}


@pytest.mark.parametrize("name", sorted(SEMCONV_BUCKETS))
def test_gen_ai_histograms_use_the_advised_buckets_and_attributes(recorded, name):
    results, points = recorded
    (point,) = points[name]  # one series: same model, no errors
    assert tuple(point.explicit_bounds) == SEMCONV_BUCKETS[name]
    assert point.count == len(results)
    assert dict(point.attributes) == {a.GEN_AI_OPERATION_NAME: "text_completion", a.GEN_AI_PROVIDER_NAME: "moespec",
                                      a.GEN_AI_REQUEST_MODEL: "target"}


def test_time_to_first_token_is_the_engine_figure(recorded):
    results, points = recorded
    (point,) = points[a.TIME_TO_FIRST_TOKEN.name]
    assert point.sum == pytest.approx(sum(r.time_to_first_token for r in results))


def test_unique_experts_per_layer_match_the_steps(engine, recorded):
    results, points = recorded
    series = {(p.attributes[a.SPEC_POLICY_ID], p.attributes[a.MOE_LAYER]): p
              for p in points[a.STEP_UNIQUE_EXPERTS.name]}
    assert len(series) == 2 * engine.info.num_layers
    for result in results:
        policy_id = result.spec.policy_id
        for layer in range(engine.info.num_layers):
            point = series[(policy_id, layer)]
            assert point.count == len(result.steps)
            assert point.sum == sum(s.unique_experts[layer] for s in result.steps)
            assert point.min >= engine.info.top_k and point.max <= engine.info.num_experts
            assert tuple(point.explicit_bounds) == unique_expert_buckets(engine.info)
            assert point.attributes[a.SPEC_DRAFTER] == result.spec.drafter.value
            assert point.attributes[a.SPEC_DRAFT_LENGTH] == result.spec.draft_length


def test_acceptance_and_cost_series_match_the_steps(recorded):
    results, points = recorded
    for result in results:
        def point(spec, policy_id=result.spec.policy_id):
            (p,) = [p for p in points[spec.name] if p.attributes[a.SPEC_POLICY_ID] == policy_id]
            return p

        steps = result.steps
        assert point(a.STEP_ACCEPTED_TOKENS).count == len(steps)
        assert point(a.STEP_ACCEPTED_TOKENS).sum == result.spec.accepted_tokens
        assert point(a.STEP_DRAFTED_TOKENS).count == len(steps)
        assert point(a.STEP_DRAFTED_TOKENS).sum == result.spec.drafted_tokens
        assert point(a.DRAFTED_TOKENS).value == result.spec.drafted_tokens
        assert point(a.COMMITTED_TOKENS).value == result.spec.committed_tokens == result.completion_tokens
        assert point(a.STEP_SECONDS).sum == pytest.approx(result.spec.draft_seconds + result.spec.verify_seconds)
        assert point(a.STEP_DECODE_STEP_EQUIVALENTS).sum == pytest.approx(
            sum(s.decode_step_equivalents for s in steps))


def test_measurements_inside_a_sampled_request_span_carry_no_exemplars(engine):
    """Every measurement of a request is taken inside its sampled span, where the SDK's default
    filter would attach exemplars (and pay a reservoir offer per measurement, on the request's path);
    the server turns them off. A data point with exemplars fails here."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    telemetry = build_telemetry_from_config(TelemetryConfig(), engine.info, extra_metric_readers=[reader],
                                            extra_span_processors=[SimpleSpanProcessor(spans)])
    try:
        generate(engine, telemetry, max_new_tokens=8)
        points = collect(reader)
    finally:
        telemetry.shutdown()
    assert any(s.context.trace_flags.sampled for s in spans.get_finished_spans())  # exemplars were possible
    assert points and all(not getattr(p, "exemplars", ()) for series in points.values() for p in series)


def test_failed_request_records_duration_with_error_type(engine):
    reader = InMemoryMetricReader()
    telemetry = build_telemetry_from_config(TelemetryConfig(), engine.info, extra_metric_readers=[reader])
    with telemetry.request(engine.info, GenerationRequest(prompt="x"), POLICY) as obs:
        obs.fail(TimeoutError("slow"), server_fault=True)
    (point,) = collect(reader)[a.REQUEST_DURATION.name]
    telemetry.shutdown()
    assert point.attributes[a.ERROR_TYPE] == "TimeoutError" and point.count == 1


def test_prometheus_endpoint_serves_the_translated_names(engine):
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the prometheus extra is not installed")
    config = TelemetryConfig.from_environ({"OTEL_METRICS_EXPORTER": "prometheus",
                                           "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                                           "OTEL_EXPORTER_PROMETHEUS_PORT": "0"})
    telemetry = build_telemetry_from_config(config, engine.info)
    try:
        generate(engine, telemetry, max_new_tokens=6)
        with urllib.request.urlopen(f"http://127.0.0.1:{telemetry.prometheus_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        telemetry.shutdown()
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for spec in a.METRICS:
        assert set(a.prometheus_series(spec)) <= series, spec.name
    assert f'{a.prometheus_label(a.MOE_LAYER)}="3"' in text
    assert f'{a.prometheus_label(a.SPEC_POLICY_ID)}="m3"' in text


def test_the_moespec_rule_reports_its_calibration_error_per_request(engine):
    """|expected - observed accepted drafts| / drafts verified, from the rule's own step predictions;
    other policies record none."""
    reader = InMemoryMetricReader()
    telemetry = build_telemetry_from_config(TelemetryConfig(), engine.info, extra_metric_readers=[reader])
    policy = DraftPolicy(Drafter.NGRAM, 8, policy_id="rule", controller=Controller.MOESPEC, cost_weight=0.05)
    result = generate(engine, telemetry, policy, max_new_tokens=48)
    generate(engine, telemetry)
    points = collect(reader)
    telemetry.shutdown()
    predicted = [s for s in result.steps if s.predicted_accepted is not None and s.drafted]
    assert predicted, "the rule drafted nothing"
    want = abs(sum(s.predicted_accepted - s.accepted for s in predicted)) / sum(s.drafted for s in predicted)
    (point,) = points[a.RULE_CALIBRATION_ERROR.name]
    assert point.attributes[a.SPEC_POLICY_ID] == "rule" and point.count == 1
    assert point.sum == pytest.approx(want)
