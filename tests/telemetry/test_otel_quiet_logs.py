"""A dead collector is reported, not repeated: the SDK exporters' repeats are filtered (serve only)."""

from __future__ import annotations

import logging

from otel.quiet_logs import EXPORTER_LOGGERS, RepeatFilter, quiet_exporter_logs


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(EXPORTER_LOGGERS[0], logging.ERROR, __file__, 1, msg, args, None)


def test_each_message_template_passes_once_per_interval():
    f = RepeatFilter(interval=300)
    template = "Failed to export %s to %s"
    assert f.filter(record(template, "traces", "a:1"))
    assert not f.filter(record(template, "traces", "a:1"))
    assert not f.filter(record(template, "metrics", "b:2"))  # same template, other arguments
    assert f.filter(record("Transient error %s", "UNAVAILABLE"))  # another template


def test_a_zero_interval_passes_everything():
    f = RepeatFilter(interval=0)
    assert f.filter(record("x")) and f.filter(record("x"))


def test_installing_twice_adds_one_filter():
    try:
        quiet_exporter_logs()
        quiet_exporter_logs()
        for name in EXPORTER_LOGGERS:
            assert sum(isinstance(f, RepeatFilter) for f in logging.getLogger(name).filters) == 1
    finally:
        for name in EXPORTER_LOGGERS:
            logger = logging.getLogger(name)
            for f in [f for f in logger.filters if isinstance(f, RepeatFilter)]:
                logger.removeFilter(f)
