"""The telemetry benchmark runs all three modes interleaved in rounds and reports each round's ratio
to off, and what each mode exported or lost.
(Throughput targets are measured by `python -m service.bench.telemetry`, not asserted on a shared test machine.)"""

from __future__ import annotations

from service.bench.telemetry import MODES, format_report, mode_order, run_benchmark
from service.types import Drafter, DraftPolicy


def test_benchmark_runs_off_live_and_unreachable_in_one_run(engine):
    results = run_benchmark(engine, rounds=2, requests=2, max_new_tokens=4,
                            policy=DraftPolicy(Drafter.MODEL, 2, policy_id="bench-test"))
    by_mode = {r.mode: r for r in results}
    assert tuple(by_mode) == MODES
    assert all(r.requests == 4 and r.tokens == 16 and r.tokens_per_second > 0 for r in results)
    assert by_mode["off"].relative == by_mode["off"].relative_min == by_mode["off"].relative_max == 1.0
    assert by_mode["off"].round_ratios == (1.0, 1.0)
    for r in results:  # the spread is over rounds, the figure their median
        assert len(r.round_ratios) == 2
        assert r.relative_min == min(r.round_ratios) <= r.relative_median <= max(r.round_ratios) == r.relative_max
    assert by_mode["off"].spans_exported == by_mode["off"].spans_dropped == 0
    assert by_mode["live"].spans_exported > 0 and by_mode["live"].spans_dropped == 0
    assert by_mode["unreachable"].spans_exported == 0 and by_mode["unreachable"].spans_dropped > 0
    report = format_report(results)
    assert all(mode in report for mode in MODES) and "round median" in report and "round range" in report


def test_every_mode_runs_first_second_and_third_equally_often():
    positions = {mode: [mode_order(i).index(mode) for i in range(6)] for mode in MODES}
    assert all(sorted(p) == [0, 0, 1, 1, 2, 2] for p in positions.values())


def test_concurrent_clients_run_in_waves_the_engine_batches(engine):
    results = run_benchmark(engine, rounds=1, requests=4, clients=2, max_new_tokens=4,
                            policy=DraftPolicy(Drafter.MODEL, 2, policy_id="bench-test"))
    assert all(r.requests == 4 and r.tokens == 16 and len(r.round_ratios) == 1 for r in results)
