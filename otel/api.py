"""What the service calls to record a request; `otel.setup` builds the real implementation.

The servicer wraps each generation in `telemetry.request(...)` (opened in the request's own
context, so the span is a child of the gRPC server span), runs the engine, then calls
`finish(result)` or `fail(error, server_fault)`. Verify-step spans and metrics are produced from the
result's StepRecords after the fact, so the engine thread never touches telemetry.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from service.types import DraftPolicy, GenerationRequest, GenerationResult, ModelInfo


class RequestObservation(Protocol):
    trace_id: str  # 32 hex digits, "" when tracing is off

    def finish(self, result: GenerationResult) -> None: ...

    def fail(self, error: BaseException, server_fault: bool) -> None: ...


class Telemetry(Protocol):
    def request(
        self, info: ModelInfo, request: GenerationRequest, policy: DraftPolicy
    ) -> AbstractContextManager[RequestObservation]: ...

    def shutdown(self) -> None: ...
