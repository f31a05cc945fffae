"""The Telemetry implementations the servicer calls (protocol in otel.api).

`OtelTelemetry` owns its own TracerProvider / MeterProvider (never the global ones, so several can
live in one process) and turns one request into: the request span (a child of whatever span is
current, i.e. the gRPC server span), verify-step spans sampled by `verify_span_ratio`, and metrics.
`NoTelemetry` is what runs when nothing is configured: no spans, no metrics, trace_id "".
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, format_trace_id

from otel import attributes as a
from otel.batch import BatchPassReporter
from otel.export import ExportStats
from otel.metrics import Instruments
from otel.spans import emit_verify_spans, request_attributes, result_attributes
from service.types import DraftPolicy, GenerationRequest, GenerationResult, InvalidRequest, ModelInfo

INSTRUMENTATION_SCOPE = "moespec"
logger = logging.getLogger(__name__)


def error_type(error: BaseException) -> str:
    """`error.type`: the exception's class name, as the semantic conventions suggest."""
    return type(error).__qualname__


class _Observation:
    """One request: holds its span until finish() or fail(); each may be called once."""

    def __init__(self, owner: OtelTelemetry, span: trace.Span, policy: DraftPolicy):
        self._owner = owner
        self._span = span
        self._policy = policy
        self._t0 = time.perf_counter()
        self.done = False
        ctx = span.get_span_context()
        # Only a sampled trace is exported; an id nobody can look up would mislead the client.
        self.trace_id = format_trace_id(ctx.trace_id) if ctx.is_valid and ctx.trace_flags.sampled else ""

    def finish(self, result: GenerationResult) -> None:
        if self.done:
            return
        self.done = True
        owner, span = self._owner, self._span
        try:
            if owner.instruments is not None:
                owner.instruments.record_request(result, time.perf_counter() - self._t0, self._policy)
            if span.is_recording():
                span.set_attributes(result_attributes(result))
                end_ns = time.time_ns()
                emit_verify_spans(owner.tracer, span, result.steps, end_ns, owner.verify_span_ratio, owner.rng)
                span.end(end_time=end_ns)
            owner.batch_passes.report(span.get_span_context(), result.steps)
        except Exception:  # telemetry must never fail a request that generated fine
            logger.warning("telemetry: recording a finished request failed", exc_info=True)
            span.end()

    def fail(self, error: BaseException, server_fault: bool) -> None:
        """A client error (bad input, cancelled) keeps the status unset; a server fault sets ERROR."""
        if self.done:
            return
        self.done = True
        kind = error_type(error)
        if self._owner.instruments is not None:
            self._owner.instruments.record_failure(time.perf_counter() - self._t0, kind)
        span = self._span
        if span.is_recording():
            span.set_attribute(a.ERROR_TYPE, kind)
            if server_fault:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"{kind}: {error}"[:512]))
            span.end()


class OtelTelemetry:
    enabled = True
    prometheus_port: int | None = None  # the scrape endpoint's bound port, when one runs

    def __init__(self, info: ModelInfo, tracer_provider: TracerProvider | None, meter_provider: MeterProvider | None,
                 *, verify_span_ratio: float, export_stats: Sequence[ExportStats] = (),
                 on_shutdown: Sequence[Callable[[], None]] = (), seed: int | None = None,
                 batched_histograms: bool = False, deferred_metrics: bool = False):
        """`batched_histograms`: `meter_provider` has otel.aggregate's view; `deferred_metrics`: values
        wait for the next collection (otel.deferred). otel.setup checks that each works."""
        self.info = info
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.verify_span_ratio = verify_span_ratio
        self.export_stats = tuple(export_stats)
        self.rng = random.Random(seed)  # our own stream: verify sampling never perturbs anyone's seeds
        self.tracer = (tracer_provider.get_tracer(INSTRUMENTATION_SCOPE) if tracer_provider is not None
                       else trace.NoOpTracer())
        self.instruments = (Instruments(meter_provider.get_meter(INSTRUMENTATION_SCOPE), info,
                                        dropped_spans=lambda: self.dropped_spans, batched=batched_histograms,
                                        deferred=deferred_metrics)
                            if meter_provider is not None else None)
        # verify_batch spans follow the verify spans' ratio: both are per-pass detail, not aggregates.
        self.batch_passes = BatchPassReporter(self.tracer, verify_span_ratio, self.rng, self.instruments)
        self._on_shutdown = tuple(on_shutdown)
        self._shutdown_lock = threading.Lock()
        self._closed = False

    @contextmanager
    def request(self, info: ModelInfo, request: GenerationRequest, policy: DraftPolicy) -> Iterator[_Observation]:
        span = self.tracer.start_span(a.request_span_name(info.model_name), kind=SpanKind.INTERNAL,
                                      attributes=request_attributes(info, request, policy))
        obs = _Observation(self, span, policy)
        # The span is current inside the block so anything the servicer logs or traces nests under it.
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            try:
                yield obs
            except BaseException as error:
                # Not reported by the servicer: bad input is the client's fault, anything else ours;
                # cancellation (client gone) is nobody's fault.
                if not obs.done:
                    server_fault = not isinstance(error, InvalidRequest | GeneratorExit) and not _is_cancel(error)
                    obs.fail(error, server_fault)
                raise
            finally:
                if not obs.done:  # neither finished nor failed: close the span rather than leak it
                    obs.done = True
                    span.end()

    def server_interceptors(self) -> list:
        from otel.interceptors import server_interceptors  # grpc instrumentation only when serving

        return server_interceptors(self.tracer_provider)

    @property
    def dropped_spans(self) -> int:
        return sum(s.dropped for s in self.export_stats)

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        ok = True
        if self.tracer_provider is not None:
            ok = self.tracer_provider.force_flush(timeout_millis) and ok
        if self.meter_provider is not None:
            ok = self.meter_provider.force_flush(timeout_millis) and ok
        return ok

    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.batch_passes.flush()  # passes whose requests did not all report (some failed)
        except Exception:
            logger.warning("telemetry: flushing batch passes failed", exc_info=True)
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        for close in self._on_shutdown:
            close()


def _is_cancel(error: BaseException) -> bool:
    return isinstance(error, asyncio.CancelledError | KeyboardInterrupt)
