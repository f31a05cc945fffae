"""The tuner benchmarks' judging logic, without a server: the noise bench scores a pick on its paired
ratio to the reference, and the shift bench's exploration cost drops pairs whose incumbent changed."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tuner.bench_noise import markdown as noise_markdown
from tuner.bench_noise import score
from tuner.bench_shift import exploration_cost


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


class FakeRunning:
    """The continuous tuner as the exploration measurement sees it: while running it costs `cost`
    of the throughput; `promote_on` lists the start numbers during which it changes the incumbent."""

    def __init__(self, cost: float, promote_on: set[int]):
        self.cost, self.promote_on, self.starts = cost, promote_on, 0
        self.running = threading.Event()
        self.tuner = SimpleNamespace(incumbent=SimpleNamespace(key="ngram k=3"))
        self.rig: FakeRig | None = None

    def start(self) -> None:
        self.rig.output_tokens()  # settle the tokens served so far at the old rate
        self.starts += 1
        self.running.set()

    def stop(self) -> None:
        self.rig.output_tokens()
        self.running.clear()
        if self.starts in self.promote_on:
            self.tuner.incumbent = SimpleNamespace(key=f"promoted {self.starts}")


class FakeRig:
    """Output tokens accrue at 1000/s, less the tuner's cost while it runs."""

    def __init__(self, running: FakeRunning):
        self.running, self.tokens, self.last = running, 0.0, time.monotonic()
        running.rig = self

    def output_tokens(self) -> int:
        now = time.monotonic()
        self.tokens += (now - self.last) * 1000.0 * ((1 - self.running.cost) if self.running.running.is_set() else 1)
        self.last = now
        return int(self.tokens)


def test_exploration_cost_alternates_and_drops_pairs_whose_incumbent_changed():
    running = FakeRunning(cost=0.04, promote_on={2})
    args = SimpleNamespace(exploration_pairs=4, steady_seconds=0.2)
    e = exploration_cost(args, FakeRig(running), running)
    assert [p["order"][0] for p in e["pairs"]] == ["exploring", "alone", "exploring", "alone"]
    assert [p["used"] for p in e["pairs"]] == [True, False, True, True]  # the second start promoted
    assert e["used_pairs"] == 3
    assert e["cost_percent_median"] == pytest.approx(4.0, abs=1.5)
    assert e["cost_percent_min"] <= e["cost_percent_median"] <= e["cost_percent_max"]
