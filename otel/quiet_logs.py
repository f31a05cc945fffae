"""Keep a dead collector from flooding the service's log.

The SDK's OTLP exporters log every failed batch (and every retry), i.e. every few seconds for as long
as the collector is down. Losses are already counted (otel.export) and reported once; this filter lets
each of the exporters' message templates through once per `interval` and drops the repeats.
Loggers are process-wide, so only the `moespec serve` entry point installs it (otel.cli), never the
library code; installing twice is a no-op.
"""

from __future__ import annotations

import logging
import threading
import time

EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
)


class RepeatFilter(logging.Filter):
    """Passes a (logger, message template) pair at most once per `interval` seconds."""

    def __init__(self, interval: float = 300.0):
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, str(record.msg)), time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                return False
            self._last[key] = now
        return True


def quiet_exporter_logs(interval: float = 300.0) -> None:
    for name in EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter(interval))
