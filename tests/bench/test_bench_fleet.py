"""`moespec bench fleet` end to end on a small budget: real replicas, real `moespec tune` workers on
one real PostgreSQL, and its judging of the picks against the reference grid."""

from __future__ import annotations

import json
import subprocess

import optuna
import pytest
from optuna.trial import TrialState

from service.bench.fleet import GRID, summarise
from tests.support.real_postgres import start_postgres
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT
from tuner.loop import study as st


def search(wall: float, measured_as: str) -> dict:
    return {"study": "s", "wall_seconds": wall, "pick": measured_as, "params": {}, "measured_as": measured_as}


def test_a_pick_is_judged_by_its_cost_over_the_grid_best_round_by_round():
    per_round = {name: [0.010, 0.012] for name in GRID}
    per_round["model k=6 T=0"] = [0.004, 0.006]  # the grid best
    per_round["pick of 3"] = [0.0042, 0.0066]  # a pick outside the grid
    result = summarise(3, 16, {"1": search(60.0, "ngram k=4"), "3": search(24.0, "pick of 3")}, per_round)
    assert result["grid_best"] == "model k=6 T=0"
    one, fleet = result["searches"]["1"], result["searches"]["3"]
    assert one["over_grid_best"] == pytest.approx(0.011 / 0.005)
    assert fleet["over_grid_best"] == pytest.approx(0.0054 / 0.005)
    assert fleet["over_grid_best_per_round"] == pytest.approx([1.05, 1.10])
    assert result["wall_fleet_over_one"] == pytest.approx(0.4)


def test_a_pick_that_is_a_grid_policy_is_that_measurement():
    per_round = {name: [0.010] for name in GRID}
    per_round["plain"] = [0.005]
    result = summarise(2, 4, {"1": search(10.0, "plain"), "2": search(10.0, "plain")}, per_round)
    assert [s["over_grid_best"] for s in result["searches"].values()] == [1.0, 1.0]
    assert "pick of 1" not in result["seconds_per_token"]


@pytest.fixture(scope="module")
def postgres():
    pg = start_postgres()
    yield pg
    pg.stop()


def test_bench_fleet_runs_one_worker_then_one_per_replica_on_one_database(postgres, tmp_path):
    url = postgres.create_database("bench_fleet")
    out = tmp_path / "out"
    cmd = [*MOESPEC, "bench", "fleet", "--storage", url, "--replicas", "2", "--trials", "3", "--max-new-tokens", "16",
           "--tune-args", "--min-tokens 32 --min-steps 4 --remeasure 1 --prune-factor 0",
           "--compare-rounds", "1", "--compare-tokens", "32", "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "fleet.json").read_text())
    assert set(result["searches"]) == {"1", "2"}
    assert (out / "fleet.png").stat().st_size > 0 and "grid best" in (out / "fleet.md").read_text()
    for workers, search in result["searches"].items():
        study = optuna.load_study(study_name=search["study"], storage=url)
        search_trials = [t for t in study.trials if st.role(t) == st.ROLE_SEARCH and t.state is TrialState.COMPLETE]
        assert len(search_trials) == 3, [(t.number, t.state, t.user_attrs) for t in study.trials]
        # each search ran its own workers only (which of them took which trial is up to timing)
        assert {t.user_attrs["tuner_id"] for t in search_trials} <= {f"w{i}" for i in range(int(workers))}
        assert study.user_attrs["winner"]["policy"] == search["pick"]
        assert search["measured_as"] in result["seconds_per_token"] and search["over_grid_best"] > 0
        winners = set()
        for i in range(int(workers)):
            lines = (out / f"{search['study']}-w{i}.log").read_text().splitlines()
            assert any(" s  trial " in line for line in lines), lines  # stamped progress lines
            winners |= {line.split("winner: ", 1)[1].split(" applied as")[0] for line in lines if "winner: " in line}
        assert len(winners) == 1, winners  # one winner for the whole fleet, from the same trials
    assert result["grid_best"] in GRID


def test_bench_fleet_refuses_a_storage_the_workers_cannot_share(tmp_path):
    run = subprocess.run([*MOESPEC, "bench", "fleet", "--storage", f"sqlite:///{tmp_path}/s.db"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "postgresql://" in run.stderr and "Traceback" not in run.stderr
