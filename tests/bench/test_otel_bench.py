"""The telemetry benchmark runs all three modes in one run and reports what each exported or lost.
(Throughput targets are measured by `python -m service.bench.telemetry`, not asserted on a shared test machine.)"""

from __future__ import annotations

from service.bench.telemetry import MODES, format_report, run_benchmark
from service.types import Drafter, DraftPolicy


def test_benchmark_runs_off_live_and_unreachable_in_one_run(engine):
    results = run_benchmark(engine, cycles=1, block=1, max_new_tokens=4,
                            policy=DraftPolicy(Drafter.MODEL, 2, policy_id="bench-test"))
    by_mode = {r.mode: r for r in results}
    assert tuple(by_mode) == MODES
    assert all(r.requests == 1 and r.tokens == 4 and r.tokens_per_second > 0 for r in results)
    assert by_mode["off"].relative == by_mode["off"].relative_min == by_mode["off"].relative_max == 1.0
    assert all(r.relative_min <= r.relative_median <= r.relative_max for r in results)
    assert by_mode["off"].spans_exported == by_mode["off"].spans_dropped == 0
    assert by_mode["live"].spans_exported > 0 and by_mode["live"].spans_dropped == 0
    assert by_mode["unreachable"].spans_exported == 0 and by_mode["unreachable"].spans_dropped > 0
    report = format_report(results)
    assert all(mode in report for mode in MODES) and "vs off" in report and "cycle range" in report
