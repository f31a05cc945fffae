"""The tuner benchmarks' judging logic, without a server: the noise bench scores a pick on its ratio
to the reference, and the exploration cost recovers each challenge round's loss from a token trace."""

from __future__ import annotations

import pytest

from service.bench.tuner_noise import markdown as noise_markdown
from service.bench.tuner_noise import score
from tuner.loop.exploration import Round, TokenTrace, back_off_rounds, round_costs, summarize


def row(policy: str, ratio: float, low: float, high: float) -> dict:
    return {"policy": policy, "paired_ratio": ratio, "paired_ratio_low": low, "paired_ratio_high": high,
            "per_round": [ratio] * 2, "seconds_per_token": 0.005 * ratio}


def test_noise_picks_are_judged_on_their_paired_ratio_to_the_reference():
    table = {"reference": {"policy": "model k=5 T=0.00", "kind": "grid best"},
             "rows": [row("plain", 1.25, 1.1, 1.4), row("ngram k=3", 1.04, 0.97, 1.12),
                      row("ngram k=8", 1.06, 1.01, 1.11)]}
    runs = [{"seed": 0, "mode": "interleaved", "controlled": True, "pick": "model k=5 T=0.00", "load_on_fraction": 0.5,
             "seconds": 1},
            {"seed": 1, "mode": "interleaved", "controlled": True, "pick": "ngram k=3", "load_on_fraction": 0.5,
             "seconds": 1},
            {"seed": 0, "mode": "sequential", "controlled": False, "pick": "ngram k=8", "load_on_fraction": 0.5,
             "seconds": 1},
            {"seed": 1, "mode": "sequential", "controlled": False, "pick": "plain", "load_on_fraction": 0.5,
             "seconds": 1}]
    result = {"runs": runs, "side_by_side": table}
    score(result, table)
    assert [r["within_5_percent"] for r in runs] == [True, True, False, False]
    assert runs[0]["over_reference"] == 1.0 and runs[1]["over_reference_interval"] == [0.97, 1.12]
    assert runs[1]["over_plain"] == pytest.approx(1.04 / 1.25)
    assert result["controlled_hits"] == "2/2" and result["sequential_hits"] == "0/2"
    text = noise_markdown(result)
    assert "controlled trials 2/2, sequential 0/2" in text and "0.970-1.120" in text


def drifting_trace(rounds: list[tuple[float, float]], round_cost: float, until: float) -> TokenTrace:
    """Output tokens of a load whose speed drifts from 1000 to 600 tokens/s over `until` seconds
    and drops by `round_cost` of it during each round, sampled every 0.2 s."""
    trace, tokens, dt, t = TokenTrace(), 0.0, 0.01, 0.0
    while t <= until:
        if round(t / dt) % 20 == 0:
            trace.add(t, tokens)
        rate = 1000.0 - 400.0 * t / until
        tokens += rate * dt * (1 - round_cost if any(a <= t < b for a, b in rounds) else 1)
        t += dt
    return trace


def test_exploration_cost_recovers_each_rounds_loss_under_drift_and_projects_the_schedule():
    """Six 6-s rounds, 20 s apart, each costing 30% of the throughput (1.8 s of incumbent time),
    while the machine slows from 1000 to 600 tokens/s: every round's loss comes out at 1.8 s
    (mutation: the alone rate from the gap before only -> 1.93 s: the drift goes into it). A round
    that changed the incumbent is not used."""
    spans = [(20.0 + 26.0 * i, 26.0 + 26.0 * i) for i in range(6)]
    trace = drifting_trace(spans, 0.3, until=spans[-1][1] + 21.0)
    rounds = [Round(a, b, floor=4.0, incumbent_changed=i == 3) for i, (a, b) in enumerate(spans)]
    costs = round_costs(trace, rounds, first_gap_start=0.0, last_gap_end=spans[-1][1] + 21.0, settle=1.0)
    assert [c.used for c in costs] == [True, True, True, False, True, True]
    for c in costs:
        assert c.lost_seconds == pytest.approx(1.8, abs=0.08)
    summary = summarize(costs, rounds, idle_seconds=5.0, max_idle_seconds=300.0)
    assert summary["lost_seconds_per_round_median"] == pytest.approx(1.8, abs=0.08)
    assert summary["measured_cost_percent"] == pytest.approx(100 * 1.8 / 26.0, abs=0.4)
    assert summary["steady_cost_percent"] == pytest.approx(100 * 1.8 / 306.0, abs=0.05)
    assert summary["first_hour_rounds"] == back_off_rounds(3600.0, 6.0, 4.0, 5.0, 300.0)


def test_back_off_schedule_counts_rounds_as_the_cli_spaces_them():
    # rounds start at 0, 6, 17, 38, 59, 80 (idle 5, 10, 20, 20, ...; each round 1 s); the seventh would end past 100
    assert back_off_rounds(100.0, round_seconds=1.0, floor=0.0, idle=5.0, max_idle=20.0) == 6
    # an idle floor above the back-off spaces them by the floor instead
    assert back_off_rounds(100.0, round_seconds=1.0, floor=30.0, idle=5.0, max_idle=20.0) == 4
