"""The report folder from a finished (synthetic) study: plots are real PNGs, json and md agree."""

from __future__ import annotations

import json

import optuna
import pytest

from service.types import Drafter, DraftPolicy
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic
from tests.tuner.test_tuner_loop import build, cost
from tuner.drivers.report import uniform_union, write_report
from tuner.loop.sampler import SamplerKind
from tuner.measurement.compare import Compared
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowStats

optuna.logging.set_verbosity(optuna.logging.WARNING)
PNG = b"\x89PNG\r\n\x1a\n"


def compared(name: str, policy: DraftPolicy, seconds: float) -> Compared:
    from tests.support.tuner_fixtures import request_span

    stats = WindowStats(name)
    stats.add(request_sample(request_span(name, steps=10, committed=20, draft_seconds=0.0,
                                          verify_seconds=seconds * 20)))
    return Compared(name, policy, stats, [seconds, seconds * 1.01])


def test_report_folder_has_plots_json_and_markdown(tmp_path):
    server = FakeServer()
    built, collector, _ = build(tmp_path, server, trials=8, sampler=SamplerKind.RANDOM)
    with SyntheticTraffic(server, collector.on_spans, cost):
        winner = built.tuner.run()
    rows = [compared("best", winner.policy, 0.0006), compared("plain", DraftPolicy(), 0.001),
            compared("default", DraftPolicy(Drafter.MODEL, 3, 1.0), 0.003)]
    out = write_report(tmp_path / "report", study=built.study, space=built.space, info=built.info, winner=winner,
                       compared=rows, storage_url="sqlite:///x.db", dashboard="optuna-dashboard sqlite:///x.db",
                       extra={"elapsed_seconds": 1.0})
    for png in ("history.png", "cost_vs_length.png", "experts_vs_length.png", "comparison.png"):
        assert (out / png).read_bytes()[:8] == PNG
    data = json.loads((out / "report.json").read_text())
    assert data["winner"]["policy_id"] == winner.policy.policy_id
    assert [c["name"] for c in data["comparison"]] == ["best", "plain", "default"]
    assert len(data["trials"]) == len(built.study.trials)
    md = (out / "report.md").read_text()
    assert "Winner" in md and "optuna-dashboard sqlite:///x.db" in md and "1.67x" in md  # 1.0 / 0.6 ms
    # Paired trials and the side-by-side ratios are shown with their intervals.
    assert "## Paired trials" in md and "candidate / control [95% interval]" in md
    assert "in one traffic split" in md  # this fake backend runs policies at once in passes of their own
    paired = [t for t in data["trials"] if t["paired_ratio"] is not None]
    bounded = [t for t in paired if t["paired_ratio_high"] is not None]
    assert bounded and all(t["paired_ratio_low"] <= t["paired_ratio"] <= t["paired_ratio_high"] for t in bounded)
    ratios = {r["name"]: r for r in data["side_by_side_ratios"]}
    assert ratios["plain"]["paired_ratio"] == pytest.approx(1.0 / 0.6)  # one request each: no interval
    assert ratios["plain"]["paired_ratio_high"] is None and "1.667x [-, -]" in md


def test_uniform_union_matches_the_architecture_note():
    assert round(uniform_union(64, 8, 5), 1) == 31.2
    assert uniform_union(64, 8, 1) == 8
