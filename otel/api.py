"""What the service calls to record a request; `otel.setup` builds the real implementation.

The servicer wraps each generation in `telemetry.request(...)` (opened in the request's own
context, so the span is a child of the gRPC server span), runs the engine, then calls
`finish(result)` or `fail(error, server_fault)`. Verify-step spans and metrics are produced from the
result's StepRecords after the fact, so the engine thread never touches telemetry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

from service.types import DraftPolicy, GenerationRequest, GenerationResult, ModelInfo

if TYPE_CHECKING:
    from otel.export import ExportStats


class RequestObservation(Protocol):
    trace_id: str  # 32 hex digits, "" when tracing is off

    def finish(self, result: GenerationResult) -> None: ...

    def fail(self, error: BaseException, server_fault: bool) -> None: ...


class Telemetry(Protocol):
    def request(
        self, info: ModelInfo, request: GenerationRequest, policy: DraftPolicy
    ) -> AbstractContextManager[RequestObservation]: ...

    def shutdown(self) -> None: ...


class _NoObservation:
    trace_id = ""

    def finish(self, result: GenerationResult) -> None:
        pass

    def fail(self, error: BaseException, server_fault: bool) -> None:
        pass


class NoTelemetry:
    """Telemetry off: the servicer's calls cost a context manager and nothing else."""

    enabled = False
    export_stats: Sequence[ExportStats] = ()

    @contextmanager
    def request(self, info: ModelInfo, request: GenerationRequest, policy: DraftPolicy) -> Iterator[_NoObservation]:
        yield _NoObservation()

    def server_interceptors(self) -> list:
        return []

    @property
    def dropped_spans(self) -> int:
        return 0

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return True

    def shutdown(self) -> None:
        pass
