"""The plain-decoding share benchmark's arithmetic: the summary pairs rounds and reports their spread
(the step limit itself: tests/bench/test_step_limit.py)."""

from __future__ import annotations

import pytest

from service.bench.bandwidth import Round, summarize


def test_the_summary_pairs_rounds_and_reports_the_spread():
    def round_(mode, r, seconds):
        return Round(mode, r, tokens=100, seconds=seconds, cpu_seconds=seconds, step_ms_median=1.0,
                     read_gbs=10.0, limit_tokens_per_second=1000.0)

    # Round 1 is slow for both modes (a busy machine): pairing by round keeps the ratio at 2.
    results = [round_("reference", 0, 2.0), round_("fast", 0, 1.0), round_("fast", 1, 3.0),
               round_("reference", 1, 6.0)]
    summary = summarize(results, 10**7, threads=1)
    assert summary["speedup_fast_over_reference"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    fast = summary["modes"]["fast"]
    assert fast["tokens_per_second"]["min"] == pytest.approx(33.3, abs=0.1)
    assert fast["tokens_per_second"]["max"] == 100.0
    assert fast["limit_tokens_per_second"]["median"] == 1000
    assert fast["share_of_limit"]["max"] == pytest.approx(0.1)


def test_the_default_step_is_paired_with_each_baseline_it_ran_beside():
    def round_(mode, r, seconds):
        return Round(mode, r, tokens=100, seconds=seconds, cpu_seconds=2 * seconds, step_ms_median=1.0,
                     read_gbs=10.0, limit_tokens_per_second=1000.0)

    # Rounds listed out of order (the bench rotates which step goes first): pairing is by round number.
    results = [round_("eager_attention", 1, 3.0), round_("fast", 0, 1.0), round_("eager_attention", 0, 1.5),
               round_("reference", 0, 4.0), round_("fast", 1, 2.0), round_("reference", 1, 8.0)]
    summary = summarize(results, 10**7, threads=1)
    assert summary["speedup_fast_over_eager_attention"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    assert summary["speedup_fast_over_reference"] == {"median": 4.0, "min": 4.0, "max": 4.0}
    assert summary["speedup_fast_over_reference_cpu"]["median"] == 4.0
    assert list(summary["modes"]) == ["reference", "eager_attention", "fast"]
