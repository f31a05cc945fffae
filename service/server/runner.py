"""Runs blocking `backend.generate` calls on worker threads for asyncio code, with admission control.

Contract:
- The event loop never runs the engine: each call goes to a thread pool of `workers` threads.
- At most `workers + max_queue` calls are admitted (running or waiting); one more raises
  `Overloaded` at once (gRPC: RESOURCE_EXHAUSTED) instead of queueing without bound.
- Cancelling the awaiting task stops the generation: a call still waiting is dropped, a running one
  sees `should_stop()` turn true at its next step and returns early. Either way its slot is freed
  and `GenerationCancelled` (an asyncio.CancelledError carrying the partial result, if any) is
  raised, so callers can still record what was computed.
- A deadline (time.monotonic() seconds) makes `should_stop()` true once it passes, so the engine
  stops even if the caller's cancellation arrives late.
- `stop_running()` (the end of a shutdown's grace period) makes every admitted call's
  `should_stop()` true without cancelling its caller: each returns its partial result normally,
  finish_reason CANCELLED, so the RPC can still answer with it.

Backends batch concurrent calls (the torch engine verifies every request in flight in one pass,
up to its `max_batch`), so the server runs as many workers as the backend has batch
slots: each worker is one caller blocked in `generate` while the backend's scheduler runs them all.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from service.backend import Backend
from service.types import DraftPolicy, GenerationRequest, GenerationResult, StreamDelta


class Overloaded(Exception):
    """Every worker is busy and the wait queue is full."""


class GenerationCancelled(asyncio.CancelledError):
    """The caller went away; `result` is the partial generation, or None if it never started."""

    def __init__(self, result: GenerationResult | None):
        super().__init__("generation cancelled")
        self.result = result


class EngineRunner:
    def __init__(self, backend: Backend, *, workers: int = 1, max_queue: int = 16):
        if workers < 1 or max_queue < 0:
            raise ValueError(f"need workers >= 1 and max_queue >= 0, got {workers}, {max_queue}")
        self._backend = backend
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moespec-engine")
        self._capacity = workers + max_queue
        self._lock = threading.Lock()  # guards _admitted and _stops: touched by loop and worker threads
        self._admitted = 0
        self._stops: set[threading.Event] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished (running + waiting)."""
        with self._lock:
            return self._admitted

    async def run(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        *,
        deadline: float | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> GenerationResult:
        stop = threading.Event()
        self._admit(stop)
        try:
            job = self._pool.submit(self._call, request, policy, stop, deadline, on_delta)
        except RuntimeError:  # pool shut down between admission and submit
            self._release(stop)
            raise Overloaded("the server is shutting down") from None
        job.add_done_callback(lambda _: self._release(stop))
        try:
            # wrap_future cancels `job` when this task is cancelled, which drops it if still queued.
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            stop.set()
            if job.cancel():  # still queued (or already dropped): it never reached the engine
                raise GenerationCancelled(None) from None
            # Running: the engine polls should_stop once per step, so this wait is one step long.
            result = await asyncio.wrap_future(job)
            raise GenerationCancelled(result) from None

    def stop_running(self) -> int:
        """Stop every admitted generation at its next step; their callers get the partial results
        (finish_reason CANCELLED) as ordinary returns. -> how many were stopped."""
        with self._lock:
            for stop in self._stops:
                stop.set()
            return len(self._stops)

    def close(self) -> None:
        """Stop every running generation, drop waiting ones, join the workers."""
        with self._lock:
            self._closed = True
            for stop in self._stops:
                stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _admit(self, stop: threading.Event) -> None:
        with self._lock:
            if self._closed:
                raise Overloaded("the server is shutting down")
            if self._admitted >= self._capacity:
                raise Overloaded(f"server busy: {self._admitted} requests running or queued (limit {self._capacity})")
            self._admitted += 1
            self._stops.add(stop)

    def _release(self, stop: threading.Event) -> None:
        with self._lock:
            if stop in self._stops:  # idempotent: submit failure and done callback may both call it
                self._stops.discard(stop)
                self._admitted -= 1

    def _call(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        stop: threading.Event,
        deadline: float | None,
        on_delta: Callable[[StreamDelta], None] | None,
    ) -> GenerationResult:
        def should_stop() -> bool:
            return stop.is_set() or (deadline is not None and time.monotonic() >= deadline)

        return self._backend.generate(request, policy, should_stop=should_stop, on_delta=on_delta)
