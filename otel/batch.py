"""Batch passes: a `verify_batch` span per sampled pass, linked to the request spans it served, and
the batch-union histograms, recorded once per pass.

A pass serves many requests, each with its own trace, and the engine never touches telemetry. So
each finished request reports its steps' pass records with its request span's context; a pass is
complete when as many requests as it served have reported (`BatchPassRecord.batch_size`). Then,
once per pass, its metrics are recorded (the passes one report completes, in one call per series:
otel.aggregate) and, for a `ratio` share of passes, a `verify_batch` span
(a root span of its own trace: it belongs to no single request) is emitted with one OTel link per
request span, timed exactly from the record's wall-clock start and durations.

A request that never reports (it failed) would leave its passes incomplete: at most `max_pending`
passes wait, and the oldest is then emitted with the links it has. `flush()` emits every waiting
pass (at shutdown). Thread-safe; never raises into the request path (the caller guards it).
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, Tracer

from otel import attributes as a
from service.types import BatchPassRecord, StepRecord


def verify_batch_attributes(record: BatchPassRecord) -> dict:
    return {
        a.BATCH_PASS_ID: record.pass_id,
        a.BATCH_SIZE: record.batch_size,
        a.BATCH_POSITIONS: record.positions,
        a.BATCH_WINDOWS: tuple(record.windows),
        a.MOE_BATCH_UNIQUE_EXPERTS: tuple(int(x) for x in record.unique_experts),
        a.MOE_BATCH_UNIQUE_EXPERTS_BOUND: record.unique_experts_bound,
        a.COST_DRAFT_SECONDS: float(record.draft_seconds),
        a.COST_VERIFY_SECONDS: float(record.verify_seconds),
        **({} if record.ep_ranks_touched is None else {  # only with --ep-size
            a.MOE_BATCH_EP_RANKS_TOUCHED: tuple(int(x) for x in record.ep_ranks_touched),
            a.MOE_BATCH_EP_MAX_RANK_EXPERTS: tuple(int(x) for x in record.ep_max_rank_experts),
            a.MOE_BATCH_EP_DISPATCH_BYTES: int(record.ep_dispatch_bytes),
        }),
    }


@dataclass
class _Pending:
    record: BatchPassRecord
    links: list[SpanContext] = field(default_factory=list)


class BatchPassReporter:
    def __init__(self, tracer: Tracer, ratio: float, rng: random.Random, instruments=None, max_pending: int = 4096):
        self._tracer = tracer
        self._ratio = ratio
        self._rng = rng
        self._instruments = instruments  # otel.metrics.Instruments or None (metrics off)
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # pass_id -> what has reported so far

    def report(self, request_span: SpanContext, steps: Iterable[StepRecord]) -> int:
        """One finished request's steps -> passes completed (and emitted) by this report."""
        complete: list[_Pending] = []
        with self._lock:
            for step in steps:
                record = step.batch
                if record is None:
                    continue
                entry = self._pending.get(record.pass_id)
                if entry is None:
                    entry = self._pending[record.pass_id] = _Pending(record)
                entry.links.append(request_span)
                if len(entry.links) >= record.batch_size:
                    complete.append(self._pending.pop(record.pass_id))
            while len(self._pending) > self._max_pending:
                complete.append(self._pending.popitem(last=False)[1])
        self._emit(complete)
        return len(complete)

    def flush(self) -> int:
        with self._lock:
            waiting = list(self._pending.values())
            self._pending.clear()
        self._emit(waiting)
        return len(waiting)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _emit(self, entries: list[_Pending]) -> None:
        if entries and self._instruments is not None:
            self._instruments.record_batch_passes([entry.record for entry in entries])
        for entry in entries:
            self._emit_span(entry)

    def _emit_span(self, entry: _Pending) -> None:
        record = entry.record
        if self._ratio <= 0 or (self._ratio < 1 and self._rng.random() >= self._ratio):
            return
        links = [Link(ctx) for ctx in entry.links if ctx.is_valid]
        # An empty Context: a root span, never the child of whichever request happened to report last.
        span = self._tracer.start_span(a.VERIFY_BATCH_SPAN_NAME, context=Context(), kind=SpanKind.INTERNAL,
                                       attributes=verify_batch_attributes(record), links=links,
                                       start_time=record.start_time_ns)
        span.end(end_time=record.end_time_ns)
