"""The telemetry benchmark runs all three modes interleaved in rounds and reports each round's ratio
to off, and what each mode exported or lost.
(Throughput targets are measured by `python -m service.bench.telemetry`, not asserted on a shared test machine.)"""

from __future__ import annotations

import pytest

from service.bench.telemetry import MODES, format_report, mode_order, paired_ratio, run_benchmark
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
        assert r.paired_low <= r.paired <= r.paired_high
    assert by_mode["off"].paired == 1.0
    assert by_mode["off"].spans_exported == by_mode["off"].spans_dropped == 0
    assert by_mode["live"].spans_exported > 0 and by_mode["live"].spans_dropped == 0
    assert by_mode["unreachable"].spans_exported == 0 and by_mode["unreachable"].spans_dropped > 0
    report = format_report(results)
    assert all(mode in report for mode in MODES) and "round median" in report and "95% CI" in report


def test_every_mode_runs_first_second_and_third_equally_often():
    positions = {mode: [mode_order(i).index(mode) for i in range(6)] for mode in MODES}
    assert all(sorted(p) == [0, 0, 1, 1, 2, 2] for p in positions.values())


def test_concurrent_clients_run_in_waves_the_engine_batches(engine):
    results = run_benchmark(engine, rounds=1, requests=4, clients=2, max_new_tokens=4,
                            policy=DraftPolicy(Drafter.MODEL, 2, policy_id="bench-test"))
    assert all(r.requests == 4 and r.tokens == 16 and len(r.round_ratios) == 1 for r in results)


def test_the_paired_figure_is_the_geometric_mean_of_wave_ratios_and_its_interval_narrows_with_waves():
    off = [100.0, 200.0, 100.0, 200.0]
    mode = [98.0, 196.0, 99.0, 194.0]  # ratios .98 .98 .99 .97
    paired, low, high = paired_ratio(mode, off)
    assert paired == pytest.approx((0.98 * 0.98 * 0.99 * 0.97) ** 0.25)
    assert low < paired < high
    _, low4, high4 = paired_ratio(mode * 4, off * 4)
    assert high4 - low4 == pytest.approx((high - low) / 2, rel=0.2)  # 4x the waves: half the width
