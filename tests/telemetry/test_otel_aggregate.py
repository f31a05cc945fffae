"""Batched histogram recording (otel/aggregate.py) exports exactly the points of recording step by step.

The service hands the SDK a request's values per series in one measurement. Two references, both
independent of that code: a plain MeterProvider (no views) fed one `record` per step, layer and
pass, as an instrumentation without batching would; and bucket counts computed with NumPy from the
steps. Known steps hit bucket boundaries (the integer histograms' values all do), land past the
last bound, carry floats whose sum depends on the order of additions, a table cell, EP fields and
passes shared by two requests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

import otel.aggregate
from otel import attributes as a
from otel.aggregate import BatchedHistogram, batching_works, histogram_view
from otel.config import TelemetryConfig
from otel.metrics import (
    accepted_token_buckets,
    batch_unique_expert_buckets,
    ep_rank_buckets,
    rank_expert_buckets,
    unique_expert_buckets,
)
from otel.setup import build_telemetry_from_config
from service.types import BatchPassRecord, Drafter, DraftPolicy, ModelInfo, StepRecord

INFO = ModelInfo(backend="test", model_name="target", draft_model_name="", num_layers=3, num_experts=16, top_k=2,
                 shared_experts=0, vocab_size=100, max_context=64, max_draft_length=4, drafters=(Drafter.NGRAM,),
                 tunable=(), expert_bytes=1, decode_step_seconds=0.01)
POLICIES = (DraftPolicy(Drafter.NGRAM, 3, policy_id="n3"), DraftPolicy(Drafter.MODEL, 4, policy_id="m4"))


def a_pass(pass_id: int, batch_size: int, unique: tuple[int, ...], ep: bool) -> BatchPassRecord:
    return BatchPassRecord(pass_id=pass_id, batch_size=batch_size, positions=4, windows=(4,) * batch_size,
                           unique_experts=unique, unique_experts_bound=8, draft_seconds=0.001, verify_seconds=0.01,
                           start_time_ns=1_000 * (pass_id + 1),
                           ep_ranks_touched=(1, 4, 16) if ep else None, ep_max_rank_experts=(3, 1, 16) if ep else None,
                           ep_dispatch_bytes=512 if ep else None)


def a_step(policy: DraftPolicy, i: int, unique: tuple[int, ...], batch: BatchPassRecord, *, cell: str = "",
           ep: bool = False) -> StepRecord:
    drafted = min(policy.draft_length, i % 5)
    accepted = min(drafted, i % 3)
    extra = dict(ep_ranks_touched=(i % 4 + 1, 2, 16), ep_max_rank_experts=(2, 2, 2), ep_dispatch_bytes=100 * i) \
        if ep else {}
    return StepRecord.of_policy(policy, drafted=drafted, accepted=accepted, committed=accepted + 1,
                                accepted_per_position=(True,) * accepted + (False,) * (drafted - accepted),
                                window=drafted + 1, unique_experts=unique, shared_experts=0, num_experts=16, top_k=2,
                                draft_seconds=0.1 * i, verify_seconds=0.0003 + 0.7 * i / 3,
                                decode_step_equivalents=1.0 + i / 7, batch=batch, cell=cell, **extra)


# Unique experts per layer: on the bounds (2..10 for this model), above the last (11-16), one step
# whose union covered two layers only.
UNIQUE = [(2, 10, 16), (3, 3, 11), (10, 2, 9), (7, 8), (2, 5, 16), (4, 9, 10)]


def requests() -> list[tuple[DraftPolicy, list[StepRecord]]]:
    """Four requests; passes 0-2 are shared by the first two, the rest belong to one request each.
    The first, second and fourth share their series; a collection after the first (see the tests)
    leaves the second and fourth in one interval, where float sums depend on the order of additions."""
    shared = [a_pass(i, 2, (2 + i, 16, 9), ep=False) for i in range(3)]
    first = [a_step(POLICIES[0], i, UNIQUE[i], shared[i], cell="k=2" if i == 1 else "") for i in range(3)]
    second = [a_step(POLICIES[0], i + 3, UNIQUE[i + 3], shared[i]) for i in range(3)]
    third = [a_step(POLICIES[1], i, UNIQUE[i], a_pass(10 + i, 1, (16 - i, 2, 3), ep=True), ep=True)
             for i in range(len(UNIQUE))]
    fourth = [a_step(POLICIES[0], i + 7, UNIQUE[-1 - i], a_pass(20 + i, 1, (5, 6, 7), ep=False)) for i in range(4)]
    return [(POLICIES[0], first), (POLICIES[0], second), (POLICIES[1], third), (POLICIES[0], fourth)]


def points(reader: InMemoryMetricReader, names: set[str]) -> dict:
    """name -> {attributes: the point's data, timestamps left out}."""
    out: dict = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name not in names:
                    continue
                for p in metric.data.data_points:
                    key = frozenset(p.attributes.items())
                    data = (p.value,) if not hasattr(p, "bucket_counts") else (
                        tuple(p.bucket_counts), p.count, p.sum, p.min, p.max, tuple(p.explicit_bounds))
                    out.setdefault(metric.name, {})[key] = data
    return out


def step_by_step_reference(reader: InMemoryMetricReader, collect_after_first) -> None:
    """One SDK measurement per step, per layer and per pass, on a provider without our view."""
    meter = MeterProvider(metric_readers=[reader], shutdown_on_exit=False).get_meter("reference")

    def histogram(spec, buckets=None):
        return meter.create_histogram(spec.name, unit=spec.unit,
                                      explicit_bucket_boundaries_advisory=list(buckets or spec.buckets))

    accepted, drafted = (histogram(s, accepted_token_buckets(INFO)) for s in (a.STEP_ACCEPTED_TOKENS,
                                                                              a.STEP_DRAFTED_TOKENS))
    unique, ranks = histogram(a.STEP_UNIQUE_EXPERTS, unique_expert_buckets(INFO)), histogram(
        a.STEP_EP_RANKS_TOUCHED, ep_rank_buckets(INFO))
    cost, seconds = histogram(a.STEP_DECODE_STEP_EQUIVALENTS), histogram(a.STEP_SECONDS)
    batch_size, batch_unique = histogram(a.BATCH_SIZE_METRIC), histogram(a.BATCH_UNIQUE_EXPERTS,
                                                                           batch_unique_expert_buckets(INFO))
    batch_ranks = histogram(a.BATCH_EP_RANKS_TOUCHED, ep_rank_buckets(INFO))
    batch_most = histogram(a.BATCH_EP_MAX_RANK_EXPERTS, rank_expert_buckets(INFO))
    drafted_total, committed_total, dispatched = (
        meter.create_counter(s.name, unit=s.unit) for s in (a.DRAFTED_TOKENS, a.COMMITTED_TOKENS, a.EP_DISPATCH_BYTES))
    waiting: dict[int, int] = {}  # pass id -> requests yet to report
    for n, (policy, steps) in enumerate(requests()):
        attrs = {a.SPEC_POLICY_ID: policy.policy_id, a.SPEC_DRAFTER: policy.drafter.value,
                 a.SPEC_DRAFT_LENGTH: policy.draft_length}
        drafted_total.add(0, attrs)
        committed_total.add(0, attrs)
        for step in steps:
            accepted.record(step.accepted, attrs)
            drafted.record(step.drafted, {**attrs, a.SPEC_CELL: step.cell} if step.cell else attrs)
            cost.record(step.decode_step_equivalents, attrs)
            seconds.record(step.draft_seconds + step.verify_seconds, attrs)
            for layer, value in enumerate(step.unique_experts):
                unique.record(value, {**attrs, a.MOE_LAYER: layer})
            for layer, value in enumerate(step.ep_ranks_touched or ()):
                ranks.record(value, {**attrs, a.MOE_LAYER: layer})
            drafted_total.add(step.drafted, attrs)
            committed_total.add(step.committed, attrs)
            if step.ep_ranks_touched is not None:
                dispatched.add(step.ep_dispatch_bytes, attrs)
        for step in steps:
            record = step.batch
            waiting[record.pass_id] = waiting.get(record.pass_id, record.batch_size) - 1
            if waiting[record.pass_id]:
                continue  # a pass counts once, when all its requests have reported
            batch_size.record(record.batch_size)
            for layer, value in enumerate(record.unique_experts):
                batch_unique.record(value, {a.MOE_LAYER: layer})
            for layer, (r, most) in enumerate(zip(record.ep_ranks_touched or (), record.ep_max_rank_experts or (),
                                                  strict=True)):
                batch_ranks.record(r, {a.MOE_LAYER: layer})
                batch_most.record(most, {a.MOE_LAYER: layer})
        if n == 0:
            collect_after_first()


def service_recording(reader: InMemoryMetricReader, collect_after_first) -> tuple[bool, bool]:
    """The service's own path: Instruments.record_steps and the batch reporter, request by request.
    -> (batched, deferred): which of otel.aggregate and otel.deferred were in effect."""
    telemetry = build_telemetry_from_config(TelemetryConfig(), INFO, extra_metric_readers=[reader])
    tracer = TracerProvider().get_tracer("t")
    try:
        for n, (policy, steps) in enumerate(requests()):
            telemetry.instruments.record_steps(steps, policy)
            span = tracer.start_span("request")
            telemetry.batch_passes.report(span.get_span_context(), steps)
            span.end()
            if n == 0:
                collect_after_first()
        return telemetry.instruments.batched, telemetry.instruments.deferred
    finally:
        telemetry.shutdown()


STEP_AND_PASS_METRICS = {s.name for s in (
    a.STEP_ACCEPTED_TOKENS, a.STEP_DRAFTED_TOKENS, a.STEP_UNIQUE_EXPERTS, a.STEP_DECODE_STEP_EQUIVALENTS,
    a.STEP_SECONDS, a.STEP_EP_RANKS_TOUCHED, a.BATCH_SIZE_METRIC, a.BATCH_UNIQUE_EXPERTS, a.BATCH_EP_RANKS_TOUCHED,
    a.BATCH_EP_MAX_RANK_EXPERTS, a.DRAFTED_TOKENS, a.COMMITTED_TOKENS, a.EP_DISPATCH_BYTES)}


def recorded_both_ways(temporality: AggregationTemporality) -> tuple[list, list, tuple[bool, bool]]:
    """[points after the first request, points at the end] of the service and of the reference."""
    def reader():
        return InMemoryMetricReader(preferred_temporality={Histogram: temporality})

    service_reader, reference_reader = reader(), reader()
    got, want = [], []
    modes = service_recording(service_reader, lambda: got.append(points(service_reader, STEP_AND_PASS_METRICS)))
    got.append(points(service_reader, STEP_AND_PASS_METRICS))
    step_by_step_reference(reference_reader, lambda: want.append(points(reference_reader, STEP_AND_PASS_METRICS)))
    want.append(points(reference_reader, STEP_AND_PASS_METRICS))
    return got, want, modes


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA],
                         ids=["cumulative", "delta"])
def test_batched_recording_exports_the_points_of_recording_each_step(temporality):
    """Values batched per series and held until the collection: the first collection (after the first
    request) and the last see exactly what recording each value on the spot gives them."""
    got, want, (batched, deferred) = recorded_both_ways(temporality)
    assert batched, "this SDK fell back to value-by-value recording: the batched path went untested"
    assert deferred, "this SDK fell back to recording on the request's thread: deferral went untested"
    assert set(want[-1]) == STEP_AND_PASS_METRICS  # every series the known steps should produce
    for got_points, want_points in zip(got, want, strict=True):
        assert got_points.keys() == want_points.keys()
        for name in want_points:
            # Exact: bucket counts, count, sum (floats too: same additions in the same order), min, max, bounds.
            assert got_points[name] == want_points[name], name


def test_per_layer_bucket_counts_equal_numpy_counts_of_the_steps():
    """No OpenTelemetry in the expectation: searchsorted(side='left') puts v in the bucket (b[i-1], b[i]]."""
    reader = InMemoryMetricReader()
    service_recording(reader, lambda: None)
    got = points(reader, {a.STEP_UNIQUE_EXPERTS.name, a.STEP_SECONDS.name})
    bounds = np.asarray(unique_expert_buckets(INFO))
    for policy in POLICIES:
        steps = [s for p, request in requests() if p is policy for s in request]
        attrs = {a.SPEC_POLICY_ID: policy.policy_id, a.SPEC_DRAFTER: policy.drafter.value,
                 a.SPEC_DRAFT_LENGTH: policy.draft_length}
        for layer in range(INFO.num_layers):
            values = np.asarray([s.unique_experts[layer] for s in steps if len(s.unique_experts) > layer])
            counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds) + 1)
            point = got[a.STEP_UNIQUE_EXPERTS.name][frozenset({**attrs, a.MOE_LAYER: layer}.items())]
            assert point[:5] == (tuple(int(c) for c in counts), len(values), int(values.sum()), values.min(),
                                 values.max())
        seconds = [s.draft_seconds + s.verify_seconds for s in steps]
        assert got[a.STEP_SECONDS.name][frozenset(attrs.items())][1:3] == (len(seconds), sum(seconds))


def test_a_batch_drops_what_record_drops():
    """Negative and non-finite values: `Histogram.record` ignores them, and so does a batch."""
    values = (3.0, -1.0, math.nan, math.inf, 0.0, 2.5, 1.0)
    batched_reader, single_reader = InMemoryMetricReader(), InMemoryMetricReader()
    batched = MeterProvider(metric_readers=[batched_reader], views=[histogram_view("m")], shutdown_on_exit=False)
    single = MeterProvider(metric_readers=[single_reader], shutdown_on_exit=False)
    for provider, is_batched in ((batched, True), (single, False)):
        histogram = provider.get_meter("m").create_histogram("h", explicit_bucket_boundaries_advisory=[1.0, 2.5])
        BatchedHistogram(histogram, is_batched).record(values, {"k": 1})
    assert points(batched_reader, {"h"}) == points(single_reader, {"h"})
    assert points(single_reader, {"h"})["h"][frozenset({("k", 1)})][:3] == ((2, 1, 1), 4, 6.5)


def test_an_sdk_whose_aggregation_is_not_the_known_one_falls_back_to_one_measurement_per_value(monkeypatch):
    """Where the SDK's histogram aggregation is some other class, the view leaves it alone, the probe
    sees that a batch is not counted value by value, and the service records each value: same points."""
    assert batching_works()
    monkeypatch.setattr(otel.aggregate, "_ExplicitBucketHistogramAggregation", type("Unknown", (), {}))
    assert not batching_works()
    got, want, modes = recorded_both_ways(AggregationTemporality.CUMULATIVE)
    assert modes == (False, False)  # deferral needs batches
    assert got == want
