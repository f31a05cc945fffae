"""The tuner against real components on loopback: `moespec serve` (embedded model, spans exported to
the tuner), the load generator, and `moespec tune` as its own process (so it can be SIGKILLed).

Budgets are tiny (16-token requests, 48-token windows) so the module runs in about a minute."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from contextlib import closing
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from service.server.client import MoespecClient
from service.types import GenerationRequest, SamplingParams
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server, telemetry_env
from tuner.loop import study as st

optuna.logging.set_verbosity(optuna.logging.WARNING)
TOKEN = "test-admin-token"
WINDOW = ("--min-tokens", "48", "--min-steps", "8", "--max-window-seconds", "30")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def otlp_port() -> int:
    # The tuner's receiver port must be known before the server starts (its OTEL endpoint), and a
    # restarted tuner binds the same one again.
    return free_port()


@pytest.fixture(scope="module")
def served(otlp_port):
    proc = start_server(telemetry_env(f"http://127.0.0.1:{otlp_port}"), TOKEN, ("--threads", "1"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def admin_client(served):
    with MoespecClient(served.address, admin_token=TOKEN) as c:
        c.wait_ready(timeout=60)
        yield c


@pytest.fixture
def load(admin_client):
    """Closed-loop traffic for the duration of one test."""
    stop = threading.Event()
    gen = LoadGenerator(admin_client, load_prompts(DEFAULT_PROMPTS), LoadSpec(concurrency=2, max_new_tokens=16))
    thread = threading.Thread(target=gen.run, args=(stop,), daemon=True)
    thread.start()
    yield gen
    stop.set()
    thread.join(30)


def tune_cmd(server_address: str, otlp_port: int, storage: str, *extra: str, study: str = "t") -> list[str]:
    return [*MOESPEC, "tune", "--server", server_address, "--otlp-listen", f"127.0.0.1:{otlp_port}",
            "--storage", storage, "--study", study, "--admin-token", TOKEN, "--seed", "0", *WINDOW, *extra]


def run_tune(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""})


def load_study(storage: str, study: str = "t") -> optuna.Study:
    return optuna.load_study(study_name=study, storage=storage)


def test_tuner_stores_valued_trials_with_attrs_and_leaves_the_best_policy_applied(served, admin_client, load,
                                                                                   otlp_port, tmp_path):
    storage = f"sqlite:///{tmp_path / 't.db'}"
    result = run_tune(tune_cmd(served.address, otlp_port, storage, "--trials", "4", "--remeasure", "2",
                               study="basic"))
    assert result.returncode == 0, result.stderr
    study = load_study(storage, "basic")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) >= 2, result.stderr
    for t in complete:
        assert t.value > 0
        assert t.user_attrs["committed_tokens"] >= 48 and t.user_attrs["verify_steps"] >= 8
        assert len(t.user_attrs["unique_experts_mean"]) == admin_client.model_info().num_layers
        for key in ("acceptance_rate", "mean_accepted_per_step", "widest_layer", "decode_step_equivalents",
                    "modelled_bytes_per_token", "requests"):
            assert key in t.user_attrs
    # The best two are re-measured, less the incumbent: it is the control the other is paired with.
    assert [t.user_attrs["role"] for t in study.trials].count(st.ROLE_REMEASURE) == 1, result.stderr
    # The embedded engine batches requests into shared passes: trials compare in separate windows.
    assert admin_client.model_info().shared_passes
    assert any(t.user_attrs.get("trial_mode") == "interleaved" for t in complete[1:]), result.stderr
    winner = study.user_attrs["winner"]
    applied = admin_client.get_policy()
    assert applied.policy_id == winner["policy_id"]
    assert applied.draft_length == winner["params"]["draft_length"]
    assert "best policy:" in result.stdout and "optuna-dashboard" in result.stdout


def trial_state(storage: optuna.storages.BaseStorage, study: str, number: int) -> TrialState | None:
    """Trial `number`'s state in the stored study (None while the study or the trial does not exist).
    A RUNNING trial reads WAITING until its tuner has stamped it as its own: killed in the instant
    between Optuna's ask and that stamp, the trial has no owner, and a restarted tuner rightly leaves
    it to the stale-heartbeat recovery (another worker's trial looks the same) instead of failing it."""
    try:
        trials = storage.get_all_trials(storage.get_study_id_from_name(study), deepcopy=False)
    except KeyError:
        return None
    if len(trials) <= number:
        return None
    trial = trials[number]
    if trial.state is TrialState.RUNNING and "tuner_id" not in trial.user_attrs:
        return TrialState.WAITING
    return trial.state


def test_sigkill_mid_trial_then_restart_resumes_without_losing_finished_trials(served, admin_client, otlp_port,
                                                                               tmp_path):
    """The kill lands in a RUNNING trial by construction, not by timing. Traffic is one request at a
    time, each sent only after the stored study shows trial 1 not yet started; so trial 1 gets at most
    one request (16 tokens), below its window's 48, and cannot complete. Pruning is off and its
    window's time limit is far beyond the test's, so it cannot be told PRUNED or FAIL either: it is
    RUNNING until the kill, whenever the kill comes."""
    db = tmp_path / "t.db"
    url = f"sqlite:///{db}"
    cmd = tune_cmd(served.address, otlp_port, url, "--trials", "3", "--remeasure", "0", "--tuner-id", "me",
                   "--prune-factor", "0", study="killed")
    cmd[cmd.index("--max-window-seconds") + 1] = "600"
    request = GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=16, sampling=SamplingParams(temperature=0))
    log = (tmp_path / "tune.log").open("w")  # a file, not a pipe nobody drains
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=log, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""})
    try:
        # Open our own storage only once the tuner has made the schema (two creators would race).
        wait_for(lambda: study_in_file(db, "killed"), 60, "the tuner's study")
        storage = st.open_storage(url)
        deadline = time.monotonic() + 180  # trial 0 needs ~3 requests; this only bounds a broken tuner
        while (state := trial_state(storage, "killed", 1)) in (None, TrialState.WAITING):
            assert proc.poll() is None, (tmp_path / "tune.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "tune.log").read_text()
            admin_client.generate(request)  # trial 0's traffic, gated on trial 1 not having started
        assert state is TrialState.RUNNING
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    before = load_study(url, "killed")
    assert before.trials[0].state is TrialState.COMPLETE
    assert before.trials[1].state is TrialState.RUNNING
    finished = {t.number: (t.state, t.value) for t in before.trials if t.state.is_finished()}

    stop = threading.Event()
    gen = LoadGenerator(admin_client, load_prompts(DEFAULT_PROMPTS), LoadSpec(concurrency=2, max_new_tokens=16))
    thread = threading.Thread(target=gen.run, args=(stop,), daemon=True)
    thread.start()
    try:
        result = run_tune(cmd)
    finally:
        stop.set()
        thread.join(30)
    assert result.returncode == 0, result.stderr
    after = load_study(url, "killed")
    assert after.trials[1].state is TrialState.FAIL
    assert after.trials[1].user_attrs["fail_reason"] == st.FAIL_INTERRUPTED
    assert {n: (after.trials[n].state, after.trials[n].value) for n in finished} == finished
    assert "1 interrupted marked FAIL" in result.stderr
    assert st.search_trials_done(after) == 3
    assert admin_client.get_policy().policy_id == after.user_attrs["winner"]["policy_id"]


def study_in_file(db: Path, name: str) -> bool:
    if not db.exists():
        return False
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:  # read-only: never creates it
        return connection.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone() is not None


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except sqlite3.Error:  # not there yet (tables not made)
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not there in {timeout} s")


def test_sigterm_mid_trial_fails_it_restores_the_incumbent_and_exits_130(served, admin_client, load, otlp_port,
                                                                          tmp_path):
    storage = f"sqlite:///{tmp_path / 't.db'}"
    cmd = tune_cmd(served.address, otlp_port, storage, "--trials", "3", "--prune-factor", "0", study="termed")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("trial 1 ["):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    study = load_study(storage, "termed")
    assert study.trials[0].state is TrialState.COMPLETE
    assert study.trials[1].state is TrialState.FAIL
    assert study.trials[1].user_attrs["fail_reason"] == st.FAIL_INTERRUPTED
    assert admin_client.get_policy().policy_id == "termed/0"  # the only complete trial is the incumbent


def run_continuous_until(cmd: list[str], marker: str) -> tuple[int, str]:
    """Start `moespec tune --continuous`, SIGTERM it once a stderr line contains `marker`."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
        return proc.returncode, "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_continuous_mode_sigterm_saves_state_and_a_restart_keeps_the_incumbent(served, admin_client, load,
                                                                                 otlp_port, tmp_path):
    storage = f"sqlite:///{tmp_path / 't.db'}"
    cmd = tune_cmd(served.address, otlp_port, storage, "--trials", "2", "--remeasure", "0", "--continuous",
                   "--exploration-share", "0.25", study="forever")
    code, err = run_continuous_until(cmd, "trial 2 [challenge]")  # the search is over, a challenger runs
    assert code == 130, err
    study = load_study(storage, "forever")
    assert "continuous" in study.user_attrs, err
    saved = study.user_attrs["continuous"]["incumbent"]
    assert [d["kind"] for d in study.user_attrs["decisions"]] == ["initial"]
    assert study.trials[2].state is TrialState.FAIL  # the interrupted challenge
    assert study.trials[2].user_attrs["role"] == st.ROLE_CHALLENGE
    assert admin_client.get_split().arms[0].policy.policy_id == saved["policy_id"]  # alone again
    assert len(admin_client.get_split().arms) == 1

    code, err = run_continuous_until(cmd, "decision initial")
    assert code == 130, err
    assert "restarted: the saved incumbent is kept" in err and saved["policy_id"] in err
    assert admin_client.get_policy().policy_id == saved["policy_id"]


def test_window_without_traffic_is_told_fail_and_the_tuner_exits_5(served, otlp_port, tmp_path):
    storage = f"sqlite:///{tmp_path / 't.db'}"
    # Its own study name: the server may still export spans of the previous tests' "t/..." ids.
    cmd = tune_cmd(served.address, otlp_port, storage, "--trials", "3", "--max-failures", "1", study="idle")
    cmd[cmd.index("--max-window-seconds") + 1] = "1"
    result = run_tune(cmd)
    assert result.returncode == 5, result.stderr
    assert "starved" in result.stderr
    trial = load_study(storage, "idle").trials[0]
    assert trial.state is TrialState.FAIL and trial.value is None
    assert trial.user_attrs["fail_reason"].startswith("starved")


def test_wrong_admin_token_exits_4(served, otlp_port, tmp_path):
    cmd = tune_cmd(served.address, otlp_port, f"sqlite:///{tmp_path / 't.db'}", "--trials", "1")
    cmd[cmd.index("--admin-token") + 1] = "wrong"
    result = run_tune(cmd, timeout=60)
    assert result.returncode == 4, result.stderr
    assert "admin token" in result.stderr


def test_unreachable_server_is_a_clear_error_with_exit_3(tmp_path):
    cmd = tune_cmd(f"127.0.0.1:{free_port()}", free_port(), f"sqlite:///{tmp_path / 't.db'}", "--connect-timeout",
                   "1")
    result = run_tune(cmd, timeout=60)
    assert result.returncode == 3
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("moespec tune: error: server unreachable")


@pytest.mark.parametrize("storage", ["nosuchdialect://x", "sqlite:////nonexistent-dir/x/t.db", "journal:"])
def test_bad_storage_url_is_a_one_line_usage_error(storage):
    result = run_tune(tune_cmd("127.0.0.1:1", free_port(), storage), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("moespec tune: error:") and len(result.stderr.strip().splitlines()) == 1


def test_loadgen_command_prints_a_summary(served):
    result = subprocess.run([*MOESPEC, "loadgen", "--server", served.address, "--count", "3", "--concurrency", "1",
                             "--max-new-tokens", "8", "--no-progress", "--json"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["requests_ok"] == 3 and summary["output_tokens"] > 0
    assert summary["latency_p99_seconds"] >= summary["latency_p50_seconds"] > 0


def test_demo_runs_server_load_and_tuner_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([*MOESPEC, "demo", "--out", str(out), "--trials", "3", "--remeasure", "1",
                             "--compare-rounds", "1", "--min-tokens", "32", "--min-steps", "8",
                             "--max-new-tokens", "16", "--threads", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("report.md", "report.json", "history.png", "cost_vs_length.png", "experts_vs_length.png",
                 "comparison.png", "study.db"):
        assert (out / name).exists(), name
    report = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in report["comparison"]] == ["best", "plain", "default"]
    assert report["comparison"][2]["policy"] == "model k=3 T=1.00"
    # The embedded engine batches: the demo's trials run between control windows, and say so.
    assert report["trial_mode"] == "interleaved"
    assert "between control windows of the incumbent" in (out / "report.md").read_text()
    assert "optuna-dashboard" in report["open_dashboard"]
    assert "trial 0 [1/3]" in result.stderr  # live progress
    assert "winner:" in result.stdout
