"""The interface every backend implements, and the factory `moespec serve` uses.

A backend is blocking and called from a worker thread; it serves one `generate` at a time or
many, as it likes, and must be safe to call from several threads. A backend that runs several at
once says how many in `max_batch` (the server then runs that many callers; absent: 1).
`should_stop` is polled once per step (cancellation, deadlines); `on_delta` receives committed
tokens as they become final.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from service.types import DraftPolicy, GenerationRequest, GenerationResult, ModelInfo, StreamDelta


class Backend(Protocol):
    info: ModelInfo

    def generate(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> GenerationResult: ...

    def close(self) -> None: ...
