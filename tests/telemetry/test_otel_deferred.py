"""Deferred metric values (otel/deferred.py): every value recorded before a collection is in it, once.

The reference is arithmetic on what the threads recorded: no OpenTelemetry in the expectation.
(That a deferred request exports the very points of recording each value on the spot, collection by
collection, is tested against a plain SDK in test_otel_aggregate.py.)
"""

from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

import otel.deferred
from otel.aggregate import BatchedHistogram, histogram_view
from otel.config import TelemetryConfig
from otel.deferred import DeferredMeasurements, deferral_works
from otel.setup import build_telemetry_from_config
from tests.telemetry.test_otel_aggregate import INFO


def a_deferred_meter(reader: InMemoryMetricReader, max_pending: int = 1 << 16):
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view("m")], shutdown_on_exit=False)
    meter = provider.get_meter("m")
    pending = DeferredMeasurements(meter, max_pending=max_pending)
    histogram = pending.histogram(BatchedHistogram(meter.create_histogram("h", explicit_bucket_boundaries_advisory=[
        100.0]), batched=True))
    counter = pending.counter(meter.create_counter("c"))
    return provider, pending, histogram, counter


def collected(reader: InMemoryMetricReader) -> dict:
    """name -> {worker: (count, sum) of a histogram point, or a counter's value}."""
    out: dict = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    value = (p.count, p.sum) if hasattr(p, "count") and hasattr(p, "bucket_counts") else p.value
                    out.setdefault(metric.name, {})[p.attributes["worker"]] = value
    return out


def test_values_recorded_by_many_threads_while_readers_collect_are_each_counted_once():
    reader = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA,
                                                         Counter: AggregationTemporality.DELTA})
    provider, _, histogram, counter = a_deferred_meter(reader)
    workers, rounds = 8, 400
    stop = threading.Event()

    def work(w: int) -> None:
        for i in range(rounds):
            values = [float(w + i), float(i % 7)]
            histogram.record(values, {"worker": w})
            counter.add(i % 5, {"worker": w})

    seen = {w: [0, 0.0, 0] for w in range(workers)}

    def absorb(points: dict) -> None:
        for w, (count, total) in points.get("h", {}).items():
            seen[w][0] += count
            seen[w][1] += total
        for w, amount in points.get("c", {}).items():
            seen[w][2] += amount

    def collect_until_stopped() -> None:
        while not stop.is_set():
            absorb(collected(reader))

    collector = threading.Thread(target=collect_until_stopped)
    collector.start()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    collector.join()
    absorb(collected(reader))  # the last interval
    for w in range(workers):  # what each worker recorded: two values and one amount per round
        assert seen[w][0] == 2 * rounds and seen[w][2] == sum(i % 5 for i in range(rounds)), w
        assert seen[w][1] == pytest.approx(sum(float(w + i) + float(i % 7) for i in range(rounds)), rel=1e-12), w
    provider.shutdown()


def test_a_reader_that_never_collects_does_not_grow_the_buffer_past_its_bound():
    reader = InMemoryMetricReader()
    provider, pending, histogram, _ = a_deferred_meter(reader, max_pending=10)
    histogram.record([1.0] * 6, {"worker": 0})
    assert pending.pending == 6
    histogram.record([2.0] * 6, {"worker": 0})  # 12 >= 10: the recording thread hands them over
    assert pending.pending == 0
    assert collected(reader)["h"][0] == (12, 18.0)
    provider.shutdown()


def test_where_a_collection_does_not_flush_first_the_service_records_on_the_spot(monkeypatch):
    """Another SDK whose collection reads storage before the callbacks (or never runs them) would
    export deferred values one collection late: the probe sees it and the service does not defer."""
    assert deferral_works()
    monkeypatch.setattr(otel.deferred.DeferredMeasurements, "_flush_on_collect", lambda self, options: [])
    assert not deferral_works()
    telemetry = build_telemetry_from_config(TelemetryConfig(), INFO, extra_metric_readers=[InMemoryMetricReader()])
    try:
        assert telemetry.instruments.batched and not telemetry.instruments.deferred
    finally:
        telemetry.shutdown()
