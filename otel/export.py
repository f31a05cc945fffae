"""Span export that can never slow generation down, and counts what it loses.

The SDK's BatchSpanProcessor already exports from its own thread; what it lacks is an account of
what was lost. `BoundedSpanProcessor` sits in front of it and admits a span only while fewer than
`max_queue_size` spans are pending (queued or in an export call), so the SDK queue never
overflows and every loss is counted here, by reason, instead:
- "queue_full": the exporter is slower than the spans arrive (collector down or slow);
- "export_failed": the exporter gave up on a batch (its own short timeout ran out).
Admission is one lock and two integer updates on the request thread; export, retries and timeouts
happen on the SDK's worker thread. The first loss is logged once per processor, never per span.
Only public SDK interfaces are used (SpanProcessor, SpanExporter).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)

QUEUE_FULL = "queue_full"
EXPORT_FAILED = "export_failed"


class ExportStats:
    """Thread-safe span accounting shared by one processor and its exporter."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._pending = 0
        self._exported = 0
        self._dropped: dict[str, int] = {QUEUE_FULL: 0, EXPORT_FAILED: 0}
        self._logged = False

    @property
    def dropped(self) -> int:
        with self._lock:
            return sum(self._dropped.values())

    @property
    def exported(self) -> int:
        with self._lock:
            return self._exported

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def dropped_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

    def admit(self) -> bool:
        """Reserve a queue slot for one span; False (and counted) when the queue is full."""
        with self._lock:
            if self._pending < self.capacity:
                self._pending += 1
                return True
        self._drop(1, QUEUE_FULL)
        return False

    def settle(self, count: int, ok: bool) -> None:
        """An export call returned: its spans leave the queue, exported or lost."""
        with self._lock:
            self._pending = max(0, self._pending - count)
            if ok:
                self._exported += count
        if not ok:
            self._drop(count, EXPORT_FAILED)

    def _drop(self, count: int, reason: str) -> None:
        with self._lock:
            self._dropped[reason] += count
            first, self._logged = not self._logged, True
        if first:
            logger.warning(
                "telemetry: dropping spans (%s); generation is not affected. Further losses are only "
                "counted (metric moespec.telemetry.dropped_spans).", reason)


class CountingSpanExporter(SpanExporter):
    """Wraps the real exporter to settle each batch in ExportStats; never raises into the worker."""

    def __init__(self, inner: SpanExporter, stats: ExportStats):
        self.inner = inner
        self.stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the SDK worker thread
            logger.debug("span exporter raised", exc_info=True)
            result = SpanExportResult.FAILURE
        self.stats.settle(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedSpanProcessor(SpanProcessor):
    """Admission control in front of a BatchSpanProcessor whose exporter is a CountingSpanExporter."""

    def __init__(self, inner: SpanProcessor, stats: ExportStats):
        self.inner = inner
        self.stats = stats

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if self.stats.admit():
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
