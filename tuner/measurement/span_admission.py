"""The tuner's span admission: which request spans may enter a trial window at all.

Contract: `SpanAdmission.admit(sample)` is True only for a span that
- comes from the replica this tuner measures: its `service.instance.id` resource attribute equals the
  instance id that replica reports in GetModelInfo (`expect`; updated when the server restarts under
  a new id). Where the server reports no id (an older server) every instance is admitted;
- carries possible aggregates: finite, non-negative seconds; non-negative counts; accepted tokens no
  more than drafted ones; committed tokens no more than its verify steps could commit (each step
  commits its accepted drafts plus the target's own token: committed <= accepted + verify_steps).
Everything refused is counted by reason (`dropped()`, the `moespec.tuner.spans_dropped` counter when a
meter is given) and logged: the first of each reason, then at 10, 100, 1000, ... of it, so a flood
cannot flood the log. Why here and not in the window: one bad sender's NaN would turn every trial
value it touches into NaN, and its huge counts would outweigh the real traffic; a window only ever
sums what passed this gate.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable

from opentelemetry.metrics import Meter

from otel import attributes as a
from tuner.measurement.window import RequestSample


class DropReason(enum.StrEnum):
    FOREIGN_INSTANCE = "foreign_instance"  # another replica's span (or one that names no instance)
    NON_FINITE_SECONDS = "non_finite_seconds"
    NEGATIVE_SECONDS = "negative_seconds"
    NEGATIVE_COUNT = "negative_count"
    ACCEPTED_OVER_DRAFTED = "accepted_over_drafted"
    COMMITTED_OVER_STEPS = "committed_over_steps"  # more than accepted + one token per verify step


def impossible(sample: RequestSample) -> tuple[DropReason, str] | None:
    """Why the span's aggregates cannot come from a real request, or None when they can."""
    seconds = {"draft_seconds": sample.draft_seconds, "verify_seconds": sample.verify_seconds}
    for name, value in seconds.items():
        if not math.isfinite(value):
            return DropReason.NON_FINITE_SECONDS, f"{name}={value}"
    for name, value in seconds.items():
        if value < 0:
            return DropReason.NEGATIVE_SECONDS, f"{name}={value}"
    counts = {"verify_steps": sample.verify_steps, "drafted_tokens": sample.drafted_tokens,
              "accepted_tokens": sample.accepted_tokens, "committed_tokens": sample.committed_tokens,
              "output_tokens": sample.output_tokens, "ep_dispatch_bytes": sample.ep_dispatch_bytes}
    for name, value in counts.items():
        if value < 0:
            return DropReason.NEGATIVE_COUNT, f"{name}={value}"
    if sample.accepted_tokens > sample.drafted_tokens:
        return DropReason.ACCEPTED_OVER_DRAFTED, f"{sample.accepted_tokens} accepted of {sample.drafted_tokens} drafted"
    if sample.committed_tokens > sample.accepted_tokens + sample.verify_steps:
        return (DropReason.COMMITTED_OVER_STEPS, f"{sample.committed_tokens} committed > {sample.accepted_tokens} "
                f"accepted + {sample.verify_steps} verify steps")
    return None


class SpanAdmission:
    def __init__(
        self,
        expected_instance: str = "",
        log: Callable[[str], None] = lambda line: None,
        meter: Meter | None = None,
        study: str = "",
    ):
        self._lock = threading.Lock()
        self._expected = expected_instance
        self._log = log
        self._study = study
        self._counts: dict[DropReason, int] = {}
        self._counter = None
        if meter is not None:
            spec = a.TUNER_SPANS_DROPPED
            self._counter = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

    def expect(self, instance_id: str) -> None:
        """Measure the replica that now reports `instance_id` (at start, and after it restarted)."""
        with self._lock:
            changed, self._expected = instance_id != self._expected, instance_id
        if changed:
            self._log(f"spans counted from instance {instance_id or '(any: the server reports no instance id)'}")

    @property
    def expected_instance(self) -> str:
        with self._lock:
            return self._expected

    def admit(self, sample: RequestSample) -> bool:
        with self._lock:
            expected = self._expected
        if expected and sample.instance_id != expected:
            self._drop(DropReason.FOREIGN_INSTANCE, sample,
                       f"instance {sample.instance_id or '(none)'}, measuring {expected}")
            return False
        why = impossible(sample)
        if why is not None:
            self._drop(why[0], sample, why[1])
            return False
        return True

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return {reason.value: n for reason, n in self._counts.items()}

    def _drop(self, reason: DropReason, sample: RequestSample, detail: str) -> None:
        with self._lock:
            n = self._counts.get(reason, 0) + 1
            self._counts[reason] = n
        if self._counter is not None:
            self._counter.add(1, {a.TUNER_DROP_REASON: reason.value, a.TUNER_STUDY: self._study})
        if math.log10(n).is_integer():  # 1, 10, 100, ...
            self._log(f"span dropped ({reason.value}, {n} so far): policy {sample.policy_id}: {detail}")
