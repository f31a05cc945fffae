"""Metric values held until a reader collects them: one SDK call per series per collection.

Batching a request's values (otel/aggregate.py) still left ~15 SDK measurements per request
(the per-step and per-pass series, the request's own histograms, the token counters), each paying
the SDK's attribute cleaning, hashing and storage lookups on the request's thread: at 16 concurrent
clients on 2 cores, ~1-2% of the machine. None of it has to happen before the next collection.

So `DeferredMeasurements` keeps each series' values in a plain list (histograms) or a running sum
(counters) under one short lock, and hands them to the SDK when a reader collects: the SDK runs the
callbacks of asynchronous instruments first thing in a collection (`MeasurementConsumer.collect`),
so a callback that observes nothing and records the pending values into the synchronous instruments
lands them in the very collection that triggered it. What is exported is what recording them on the
spot would export: the same points in the same collections (a collection sees every value recorded
before it started), sums added in the order the values arrived. A reader that never collects is
bounded: past `max_pending` values the recording thread flushes them itself.

`deferral_works()` checks that ordering on a throwaway provider whenever telemetry is built; where it
does not hold (another SDK version), values are recorded on the spot as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from opentelemetry.metrics import CallbackOptions, Counter, Meter, Observation
from opentelemetry.util.types import Attributes

from otel.aggregate import BatchedHistogram, sdk_probe

logger = logging.getLogger(__name__)

# An observable instrument that never observes: its callback is the flush. It exports no points.
FLUSH_INSTRUMENT = "moespec.telemetry.deferred_flush"


def _series_key(instrument: object, attributes: Attributes) -> tuple:
    return id(instrument), tuple(attributes.items()) if attributes else ()


class DeferredMeasurements:
    """Pending histogram values and counter amounts per series, flushed at each collection."""

    def __init__(self, meter: Meter, *, max_pending: int = 1 << 16):
        self._max_pending = max_pending
        self._lock = threading.Lock()  # held for a dict update on the request's thread
        self._flush_lock = threading.Lock()  # one flush at a time: values reach the SDK in arrival order
        self._histograms: dict[tuple, tuple[BatchedHistogram, Attributes, list[float]]] = {}
        self._counters: dict[tuple, tuple[Counter, Attributes, list[float]]] = {}
        self._pending = 0
        meter.create_observable_gauge(FLUSH_INSTRUMENT, [self._flush_on_collect],
                                      description="flushes moespec's deferred metric values; no points")

    @property
    def pending(self) -> int:
        """Histogram values waiting for a collection."""
        return self._pending

    def histogram(self, histogram: BatchedHistogram) -> DeferredHistogram:
        return DeferredHistogram(self, histogram)

    def counter(self, counter: Counter) -> DeferredCounter:
        return DeferredCounter(self, counter)

    def add_values(self, histogram: BatchedHistogram, values: Sequence[float], attributes: Attributes) -> None:
        if not values:
            return
        key = _series_key(histogram, attributes)
        with self._lock:
            entry = self._histograms.get(key)
            if entry is None:
                self._histograms[key] = (histogram, attributes, list(values))
            else:
                entry[2].extend(values)
            self._pending += len(values)
            full = self._pending >= self._max_pending
        if full:
            self.flush()

    def add_amount(self, counter: Counter, amount: float, attributes: Attributes) -> None:
        key = _series_key(counter, attributes)
        with self._lock:
            entry = self._counters.get(key)
            if entry is None:
                self._counters[key] = (counter, attributes, [amount])
            else:
                entry[2][0] += amount

    def flush(self) -> None:
        """Hand everything pending to the SDK (also called by every collection)."""
        with self._flush_lock:
            with self._lock:
                histograms, self._histograms = self._histograms, {}
                counters, self._counters = self._counters, {}
                self._pending = 0
            for histogram, attributes, values in histograms.values():
                histogram.record(values, attributes)
            for counter, attributes, (amount,) in counters.values():
                counter.add(amount, attributes)

    def _flush_on_collect(self, _: CallbackOptions) -> list[Observation]:
        try:
            self.flush()
        except Exception:  # a collection must go on; the values of this flush are lost, and said so
            logger.warning("telemetry: flushing deferred metric values failed", exc_info=True)
        return []


class DeferredHistogram:
    """`BatchedHistogram`'s interface; the values wait for the next collection."""

    def __init__(self, owner: DeferredMeasurements, histogram: BatchedHistogram):
        self._owner = owner
        self._histogram = histogram

    def record(self, values: Sequence[float], attributes: Attributes) -> None:
        self._owner.add_values(self._histogram, values, attributes)


class DeferredCounter:
    """A counter's `add`; the amounts of a series are summed until the next collection."""

    def __init__(self, owner: DeferredMeasurements, counter: Counter):
        self._owner = owner
        self._counter = counter

    def add(self, amount: float, attributes: Attributes = None) -> None:
        self._owner.add_amount(self._counter, amount, attributes)


def deferral_works() -> bool:
    """Does a collection see what was deferred before it, and export no point of its own?"""
    def check(meter: Meter, collect) -> bool:
        deferred = DeferredMeasurements(meter)
        histogram = BatchedHistogram(meter.create_histogram("h", explicit_bucket_boundaries_advisory=[1.0]), True)
        deferred.histogram(histogram).record([0.5, 2.0], {"k": "v"})
        deferred.counter(meter.create_counter("c")).add(3, {"k": "v"})
        got = collect()
        return (set(got) == {"h", "c"} and tuple(got["h"].bucket_counts) == (1, 1) and got["h"].sum == 2.5
                and got["c"].value == 3)

    return sdk_probe("flush deferred values at collection", check,
                     "recording metric values on the request's thread (same metrics, more CPU per request)")
