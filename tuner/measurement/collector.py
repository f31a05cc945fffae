"""Request spans in, per-policy windows out: the bridge between the OTLP receiver and the tuner.

Contract: `on_spans` is the receiver's callback (called on its gRPC threads); it keeps only request
spans whose policy id is being watched, so memory stays bounded however long the server runs.
`wait` blocks until the watched window changes or a timeout passes and returns a snapshot copy.
Counters of everything seen (watched or not) make "no traffic" diagnosable: zero spans at all means
telemetry is not reaching the tuner; spans for other ids mean the server runs another policy.
A window keeps at most `max_window_requests` requests (each costs a per-request entry for the
confidence interval); samples beyond that are dropped and counted (`Traffic.dropped_spans`), so a
flood of spans (real or forged) cannot grow the tuner's memory without bound.
`admit` (tuner/span_admission.py) refuses spans before anything is counted: another replica's, impossible ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tuner.measurement.window import RequestSample, WindowStats


@dataclass(frozen=True)
class Traffic:
    request_spans: int  # all request spans received
    unwatched_spans: int  # of which for a policy id nobody watches
    last_span_at: float | None  # clock() of the last request span
    dropped_spans: int = 0  # of which dropped because their window was full (max_window_requests)


# Far more than any trial window needs (min_tokens 256 is a few dozen requests; a 60 s window at 100
# requests per second is 6000), few enough that a full window stays around a megabyte.
DEFAULT_MAX_WINDOW_REQUESTS = 20_000


class SpanCollector:
    def __init__(
        self,
        parse: Callable[[Mapping], RequestSample | None],
        clock: Callable[[], float] = time.monotonic,
        max_window_requests: int = DEFAULT_MAX_WINDOW_REQUESTS,
        admit: Callable[[RequestSample], bool] = lambda sample: True,
    ):
        if max_window_requests < 1:
            raise ValueError(f"max_window_requests must be >= 1, got {max_window_requests}")
        self._parse = parse
        self._admit = admit
        self._clock = clock
        self._max_window_requests = max_window_requests
        self._dropped = 0
        self._cond = threading.Condition()
        self._windows: dict[str, WindowStats] = {}
        self._accept: dict[str, Callable[[RequestSample], bool]] = {}
        self._request_spans = 0
        self._unwatched = 0
        self._last_span_at: float | None = None

    def on_spans(self, spans: Iterable[Mapping]) -> None:
        samples = [s for s in (self._parse(span) for span in spans) if s is not None and self._admit(s)]
        if not samples:
            return
        with self._cond:
            for sample in samples:
                self._request_spans += 1
                self._last_span_at = self._clock()
                window = self._windows.get(sample.policy_id)
                if window is None or not self._accept[sample.policy_id](sample):
                    self._unwatched += 1
                elif window.requests >= self._max_window_requests:
                    self._dropped += 1
                else:
                    window.add(sample)
            self._cond.notify_all()

    def watch(self, policy_id: str, accept: Callable[[RequestSample], bool] = lambda s: True) -> None:
        """Start a fresh window for `policy_id` (call before the policy is applied); samples that
        `accept` refuses are counted as unwatched instead."""
        with self._cond:
            self._windows[policy_id] = WindowStats(policy_id)
            self._accept[policy_id] = accept

    def unwatch(self, policy_id: str) -> None:
        with self._cond:
            self._windows.pop(policy_id, None)
            self._accept.pop(policy_id, None)

    def snapshot(self, policy_id: str) -> WindowStats:
        with self._cond:
            return self._windows[policy_id].copy()

    def wait(self, policy_id: str, after_requests: int, timeout: float) -> WindowStats:
        """Return once the window holds more than `after_requests` requests, or after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._windows[policy_id].requests > after_requests, timeout=timeout)
            return self._windows[policy_id].copy()

    def traffic(self) -> Traffic:
        with self._cond:
            return Traffic(self._request_spans, self._unwatched, self._last_span_at, self._dropped)
