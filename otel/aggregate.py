"""Histograms recorded a request at a time: one SDK measurement carries all of a series' values.

Each `Histogram.record` call costs the SDK a Measurement, a copy, cleaning and hashing of the
attributes and a storage lookup, per reader; the per-step, per-layer and per-pass histograms
made that ~290 calls per 32-token request on the 4-layer model (~12 ms of CPU on a loaded 2-core
machine: several % of a single stream's time). The values themselves only need `sum += v`, `min`,
`max` and one bucket increment.

So `Instruments` gathers a request's values per series (instrument + attribute set) in plain lists
and records each list once: `BatchedHistogram.record(values, attributes)` sends one measurement
whose Context carries the values, and `BatchedHistogramAggregation` (a View on our meter's
histograms, installed by `otel.setup`) counts them into buckets with the SDK's rule and adds the
counts, the sum (value by value, in order), min and max to the SDK's own explicit-bucket state.
What depends on the attributes alone (the same for every value of the list) is paid once. The
exported points are those of recording the values one by one: the same bucket counts, count, min,
max and, float for float, sum. The values the SDK's `record` drops (negative, not finite) are
dropped here too. Exemplars are not offered for batched values (the server turns them off).

The aggregation writes the SDK's internal state (`_value`, `_sum`, `_min`, `_max`).
`batching_works()` checks that against a known result whenever telemetry is built; where it does
not hold (another SDK version), `Instruments` records value by value, as before.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence

from opentelemetry.context import create_key, get_value, set_value
from opentelemetry.context.context import Context
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.util.types import Attributes

logger = logging.getLogger(__name__)

_VALUES_KEY = create_key("moespec.histogram.values")  # a str constant: where a measurement carries its values


def _recordable(value: float) -> bool:
    """What `Histogram.record` would keep: it drops non-finite and negative amounts."""
    return math.isfinite(value) and value >= 0


class _BatchedBucketHistogram(_ExplicitBucketHistogramAggregation):
    """The SDK's explicit-bucket aggregation, also taking a batch of values in one measurement."""

    def aggregate(self, measurement, should_sample_exemplar: bool = True) -> None:
        values = get_value(_VALUES_KEY, measurement.context) if measurement.context is not None else None
        if values is None:  # an ordinary measurement
            super().aggregate(measurement, should_sample_exemplar)
            return
        kept = [v for v in values if _recordable(v)]
        if not kept:
            return
        # The SDK's own rule, value by value (bisect_left: a bucket holds (previous bound, bound]),
        # counted outside the lock; under it, a few integer adds per distinct bucket.
        buckets = Counter(bisect_left(self._boundaries, v) for v in kept)
        with self._lock:
            if self._value is None:
                self._value = self._get_empty_bucket_counts()
            for bucket, count in buckets.items():
                self._value[bucket] += count
            total = self._sum
            for value in kept:  # one addition per value, in order: the float sum of recording them singly
                total += value
            self._sum = total
            if self._record_min_max:
                self._min = min(self._min, min(kept))
                self._max = max(self._max, max(kept))


class BatchedHistogramAggregation(ExplicitBucketHistogramAggregation):
    """The default histogram aggregation (the instrument's advised boundaries), batch-aware."""

    def _create_aggregation(self, *args, **kwargs):
        aggregation = super()._create_aggregation(*args, **kwargs)
        # Re-class the SDK's own object rather than construct one: its constructor's arguments
        # (boundaries from the advisory, temporality, reservoir) are the SDK's business and change
        # between versions; the subclass only overrides `aggregate`.
        if type(aggregation) is _ExplicitBucketHistogramAggregation:
            aggregation.__class__ = _BatchedBucketHistogram
        return aggregation


def histogram_view(meter_name: str) -> View:
    """Every histogram of `meter_name` (and no one else's) gets the batch-aware aggregation."""
    return View(instrument_type=SdkHistogram, meter_name=meter_name, aggregation=BatchedHistogramAggregation())


class BatchedHistogram:
    """A histogram instrument that takes a list of values per call.

    `batched`: the meter provider has `histogram_view` and `batching_works()` held; otherwise each
    value is its own measurement (the same points, at the SDK's per-call cost).
    """

    def __init__(self, histogram: Histogram, batched: bool):
        self._histogram = histogram
        self._batched = batched

    def record(self, values: Sequence[float], attributes: Attributes) -> None:
        if not values:
            return
        if not self._batched:
            for value in values:
                self._histogram.record(value, attributes)
            return
        # The amount itself is ignored by the aggregation; 0 passes the SDK's checks.
        self._histogram.record(0, attributes, context=set_value(_VALUES_KEY, tuple(values), Context()))


def sdk_probe(what: str, check: Callable[[Meter, Callable[[], dict]], bool], fallback: str) -> bool:
    """Does this SDK do `what`? `check(meter, collect)` on a throwaway provider (milliseconds, once per
    Telemetry, never on the request path); collect() -> {metric name: its first data point}. False,
    with one warning saying `fallback`, when the check fails or raises."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[histogram_view("probe")], shutdown_on_exit=False)

    def collect() -> dict:
        return {m.name: m.data.data_points[0] for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if m.data.data_points}

    try:
        ok = check(provider.get_meter("probe"), collect)
    except Exception:
        logger.debug("telemetry probe (%s) raised", what, exc_info=True)
        ok = False
    finally:
        provider.shutdown()
    if not ok:
        logger.warning("telemetry: this OpenTelemetry SDK does not %s; %s", what, fallback)
    return ok


def batching_works() -> bool:
    """Does this SDK aggregate a batch exactly as it would the values one by one?"""
    values, bounds = (3, 0.5, 7, 2, -1.0, math.nan), (1.0, 3.0)  # the last two are dropped, as by record()

    def check(meter: Meter, collect: Callable[[], dict]) -> bool:
        BatchedHistogram(meter.create_histogram("probe", explicit_bucket_boundaries_advisory=bounds),
                         batched=True).record(values, {"k": "v"})
        got = collect()
        point = got.get("probe")
        return set(got) == {"probe"} and (tuple(point.bucket_counts), point.sum, point.count, point.min,
                                          point.max) == ((1, 2, 1), 12.5, 4, 0.5, 7)

    return sdk_probe("take batched histogram values", check,
                     "recording every value on its own (same metrics, more CPU per request)")
