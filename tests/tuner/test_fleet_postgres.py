"""Fleet tuning against real components: a private PostgreSQL holding one Optuna study, two
`moespec serve` replicas (one kernel thread each), and `moespec tune` workers as their own processes,
one per replica (so they can be SIGKILLed).

Each scenario is built so that what it checks happens by construction, not by timing: a worker whose
replica gets no traffic stays inside its RUNNING trial for as long as the test wants (its window
cannot fill, pruning is off and its time limit is far away). Budgets are tiny: 16-token requests,
48-token sequential windows."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import optuna
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from optuna.trial import TrialState

from otel import attributes as attr
from service.server.client import MoespecClient
from tests.support.real_backends import free_port, wait_until
from tests.support.real_postgres import start_postgres
from tests.support.tuner_fixtures import request_span
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server, stop_process, telemetry_env
from tuner.loop import study as st
from tuner.loop.space import SearchSpace, policy_key

optuna.logging.set_verbosity(optuna.logging.WARNING)
TOKEN = "fleet-admin-token"
WINDOW = ("--min-tokens", "48", "--min-steps", "8", "--trial-mode", "sequential", "--prune-factor", "0")
SERVE = ("--threads", "1", "--kernel-threads", "1", "--max-batch", "2")


@pytest.fixture(scope="module")
def postgres():
    pg = start_postgres()
    yield pg
    pg.stop()


class Replica:
    """A `moespec serve` exporting to the receiver port its worker will bind, and its load switch."""

    def __init__(self, instance_id: str | None):
        self.otlp_port = free_port()
        extra = (*SERVE, *(("--instance-id", instance_id) if instance_id else ()))
        self.proc = start_server(telemetry_env(f"http://127.0.0.1:{self.otlp_port}"), TOKEN, extra)
        self.client = MoespecClient(self.proc.address, admin_token=TOKEN)
        self.client.wait_ready(timeout=60)
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def load_on(self) -> None:
        self._stop = threading.Event()
        gen = LoadGenerator(self.client, load_prompts(DEFAULT_PROMPTS), LoadSpec(concurrency=1, max_new_tokens=16))
        self._thread = threading.Thread(target=gen.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def load_off(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(30)
            self._stop = None

    def close(self) -> None:
        self.load_off()
        self.client.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def replicas():
    a, b = Replica("replica-a"), Replica(None)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(autouse=True)
def quiet(replicas):
    yield
    for r in replicas:
        r.load_off()


class Worker:
    """`moespec tune` for one replica; stderr goes to a file (no pipe to drain), read by `log()`."""

    def __init__(self, replica: Replica, storage: str, worker_id: str, tmp: Path, *extra: str, study: str):
        self.id = worker_id
        self.path = tmp / f"{worker_id}.log"
        cmd = [*MOESPEC, "tune", "--server", replica.proc.address, "--otlp-listen", f"127.0.0.1:{replica.otlp_port}",
               "--storage", storage, "--study", study, "--tuner-id", worker_id, "--admin-token", TOKEN,
               "--seed", "0", "--max-window-seconds", "600", "--stale-seconds", "4", *WINDOW, *extra]
        self._out = self.path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=self._out, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""})

    def log(self) -> str:
        return self.path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 180) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None or text in self.log(), f"{self.id} exited:\n{self.log()}"
            return text in self.log()

        wait_until(seen, timeout, interval=0.2, what=f"{self.id}: {text!r}")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    def stop(self) -> None:
        stop_process(self.proc, 30)
        self._out.close()


def running_trial(storage: str, study: str, worker: str) -> optuna.trial.FrozenTrial | None:
    try:
        s = optuna.load_study(study_name=study, storage=storage)
    except KeyError:
        return None
    return next((t for t in s.get_trials(states=(TrialState.RUNNING,)) if t.user_attrs.get("tuner_id") == worker),
                None)


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that really measured traffic (not copies of a measured policy, not refused)."""
    return [t for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
            if "duplicate_of" not in t.user_attrs]


def space_of(replica: Replica) -> SearchSpace:
    return SearchSpace.from_model_info(replica.client.model_info())


def test_replicas_report_their_instance_ids(replicas):
    a, b = replicas
    assert a.client.model_info().instance_id == "replica-a"
    generated = b.client.model_info().instance_id
    assert len(generated) == 36 and generated != "replica-a"  # a fresh UUID: none was configured


class Intruder:
    """A second sender aimed at a worker's receiver, as anything reaching it through a shared
    Collector could be: spans with the worker's own policy id, from another instance (a tiny,
    possible cost) and from the worker's own instance with impossible aggregates."""

    def __init__(self, port: int, own_instance: str, policy_id: str):
        self._providers = []
        self._stop = threading.Event()
        foreign = request_span(policy_id, steps=1000, committed=1000, accepted=0, drafted=0, verify_seconds=1e-6,
                               draft_seconds=0.0)
        impossible = request_span(policy_id, verify_seconds=math.nan)
        plan = [("replica-elsewhere", foreign), (own_instance, impossible)]
        self._senders = []
        for instance, span in plan:
            provider = TracerProvider(resource=Resource({attr.RESOURCE_SERVICE_INSTANCE_ID: instance}),
                                      shutdown_on_exit=False)
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}",
                                                                            insecure=True)))
            self._providers.append(provider)
            self._senders.append((provider.get_tracer("intruder"), span))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for tracer, span in self._senders:
                tracer.start_span(span["name"], attributes=span["attributes"]).end()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for p in self._providers:
            p.shutdown()


def test_two_workers_never_measure_one_policy_at_once_and_finish_the_budget_together(postgres, replicas, tmp_path):
    """Plain decoding is queued twice. Worker A takes the first copy while its replica has no traffic,
    so it stays inside that trial; worker B, started then, is handed the second copy and must refuse
    it (told FAIL "busy", not counted) instead of measuring plain beside A. Meanwhile an intruder
    sprays A's receiver with spans carrying A's running policy id: another instance's (1000 cheap
    tokens) and A's own instance's with NaN seconds. None may enter A's window."""
    a, b = replicas
    storage = postgres.create_database("fleet_budget")
    study_name, budget = "budget", 5
    study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize")
    for _ in range(2):
        study.enqueue_trial({"draft_length": 0}, user_attrs={"role": st.ROLE_SEARCH})
    extra = ("--trials", str(budget), "--remeasure", "1")
    wa = Worker(a, storage, "worker-a", tmp_path, *extra, study=study_name)
    wb = None
    intruder = None
    try:
        wait_until(lambda: running_trial(storage, study_name, "worker-a"), 120, what="worker A inside trial 0")
        first = running_trial(storage, study_name, "worker-a")
        assert first.number == 0
        intruder = Intruder(a.otlp_port, "replica-a", f"{study_name}/0")
        wb = Worker(b, storage, "worker-b", tmp_path, *extra, study=study_name)
        b.load_on()
        wb.wait_for("busy: plain is being measured by worker-a trial 0")
        a.load_on()  # now A's trial can fill
        assert wa.wait() == 0, wa.log()
        assert wb.wait() == 0, wb.log()
    finally:
        if intruder is not None:
            intruder.stop()
        for w in (wa, wb):
            if w is not None and w.proc.poll() is None:
                w.stop()
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials()
    # B refused the second copy of plain while A measured it: a FAIL that did not count.
    busy = [t for t in trials if str(t.user_attrs.get("fail_reason", "")).startswith(st.FAIL_BUSY)]
    assert busy and busy[0].number == 1 and busy[0].user_attrs["tuner_id"] == "worker-b"
    # No two measurements of one policy overlapped in time.
    space = space_of(a)
    spans_by_policy: dict = {}
    for t in measured(study):
        spans_by_policy.setdefault(policy_key(space.policy_from_params(t.params, "")), []).append(
            (t.datetime_start, t.datetime_complete, t.user_attrs["tuner_id"]))
    for key, intervals in spans_by_policy.items():
        intervals.sort()
        for (_, end, _), (start, _, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end, f"{key.label()} measured twice at once: {intervals}"
    # Together exactly the budget (B took part: the busy refusal above), and both replicas end on the
    # one winner. Whether B also completes a trial of the budget depends on timing: on 2 loaded
    # cores A once finished all five while B, after its refusal, had completed none.
    assert st.search_trials_done(study) == budget
    completed = {t.user_attrs["tuner_id"] for t in trials if t.state is TrialState.COMPLETE}
    assert "worker-a" in completed and completed <= {"worker-a", "worker-b"}
    winner = study.user_attrs["winner"]["policy_id"]
    assert a.client.get_policy().policy_id == winner and b.client.get_policy().policy_id == winner
    # The intruder's spans never reached A's window; both kinds were dropped, counted and logged.
    assert trials[0].state is TrialState.COMPLETE and trials[0].user_attrs["committed_tokens"] < 1000
    assert math.isfinite(trials[0].value)
    assert "span dropped (foreign_instance, 1 so far)" in wa.log()
    assert "span dropped (non_finite_seconds, 1 so far)" in wa.log()
    assert "spans counted from instance replica-a" in wa.log()


def test_sigkill_of_a_worker_mid_trial_loses_nothing_and_the_other_carries_on(postgres, replicas, tmp_path):
    """Worker A's replica has no traffic, so A is inside its trial when it is killed, whenever that
    is. B (with traffic) has finished a trial of its own by then and finishes the budget alone: A's
    RUNNING trial is failed once its heartbeat is stale (--stale-seconds 4) and never counted."""
    a, b = replicas
    storage = postgres.create_database("fleet_kill")
    study_name, budget = "kill", 4
    extra = ("--trials", str(budget), "--remeasure", "0")
    wa = Worker(a, storage, "worker-a", tmp_path, *extra, study=study_name)
    wb = None
    try:
        wait_until(lambda: running_trial(storage, study_name, "worker-a"), 120, what="worker A inside a trial")
        victim = running_trial(storage, study_name, "worker-a").number
        b.load_on()
        wb = Worker(b, storage, "worker-b", tmp_path, *extra, study=study_name)
        wb.wait_for(" COMPLETE ")  # B measured a trial while A sat in its own
        before = {t.number: (t.state, t.value) for t in
                  optuna.load_study(study_name=study_name, storage=storage).get_trials() if t.state.is_finished()}
        wa.proc.send_signal(signal.SIGKILL)
        wa.wait(10)
        assert wb.wait() == 0, wb.log()
    finally:
        for w in (wa, wb):
            if w is not None and w.proc.poll() is None:
                w.stop()
    study = optuna.load_study(study_name=study_name, storage=storage)
    killed = study.trials[victim]
    assert killed.state is TrialState.FAIL and killed.user_attrs["fail_reason"] == st.FAIL_INTERRUPTED
    assert {n: (study.trials[n].state, study.trials[n].value) for n in before} == before  # nothing lost
    assert st.search_trials_done(study) == budget  # the killed trial did not count
    assert all(t.user_attrs["tuner_id"] == "worker-b" for t in measured(study))
    assert b.client.get_policy().policy_id == study.user_attrs["winner"]["policy_id"]


def test_the_fleet_incumbent_is_applied_on_every_replica_even_mid_challenge(postgres, replicas, tmp_path):
    """Two continuous workers share a search; both replicas then run the one incumbent. When the
    study's incumbent changes (as when any worker promotes) while each worker sits in a challenge,
    both stop their challenges (told FAIL "superseded", not counted) and apply the new one.

    Mid-challenge by construction: with both loads off, a running challenge cannot finish (no request
    can run its policy), and the windows' limit (--max-window-seconds 600) outlasts the test."""
    a, b = replicas
    storage = postgres.create_database("fleet_incumbent")
    study_name = "inc"
    extra = ("--trials", "3", "--remeasure", "0", "--continuous", "--exploration-share", "0.25")
    a.load_on()
    b.load_on()
    workers = [Worker(r, storage, f"worker-{n}", tmp_path, *extra, study=study_name) for r, n in zip(replicas, "ab",
                                                                                                     strict=True)]
    try:
        for w in workers:
            w.wait_for("decision initial")
        root = optuna.load_study(study_name=study_name, storage=storage)
        incumbent = root.user_attrs["continuous"]["incumbent"]
        a.load_off()
        b.load_off()
        time.sleep(2)  # the last request's spans land (exported every 200 ms): no window can fill after this

        def stuck_challenge(worker: Worker) -> optuna.trial.FrozenTrial | None:
            """The worker's running challenge, if it is still the same one a while later: one asked before
            the loads stopped (and stuck since) counts as much as one asked after."""
            t = running_trial(storage, study_name, worker.id)
            if t is None or st.role(t) != st.ROLE_CHALLENGE:
                return None
            time.sleep(2)
            again = running_trial(storage, study_name, worker.id)
            return again if again is not None and again.number == t.number else None

        stuck = [wait_until(lambda w=w: stuck_challenge(w), 180, what=f"{w.id} inside a challenge with no traffic")
                 for w in workers]
        # Another worker promoted a policy: the study says so, every replica follows, mid-challenge.
        space = space_of(a)
        promoted = space.policy_from_params({"draft_length": 0}, f"{study_name}/promoted")
        state = dict(root.user_attrs["continuous"])
        state["incumbent"] = {"params": space.params_of(promoted), "policy_id": promoted.policy_id,
                              "value": incumbent["value"] * 0.9, "trial": incumbent["trial"], "label": "plain"}
        root.set_user_attr("continuous", state)
        try:
            wait_until(lambda: all(r.client.get_policy().policy_id == promoted.policy_id for r in replicas), 60,
                       what="both replicas on the promoted policy")
        except TimeoutError as e:
            raise AssertionError("\n".join([str(e), *(f"--- {w.id}:\n{w.log()}" for w in workers)])) from e
        for w, trial in zip(workers, stuck, strict=True):
            w.wait_for(f"fleet incumbent adopted: plain ({promoted.policy_id})")
            assert "challenge stopped: the fleet's incumbent is now plain" in w.log()
            assert w.proc.poll() is None
            told = root.trials[trial.number]
            assert told.state is TrialState.FAIL
            assert told.user_attrs["fail_reason"].startswith(st.FAIL_SUPERSEDED)
            assert not st.counts_towards_budget(told)
    finally:
        for w in workers:
            w.stop()


def test_a_worker_survives_its_server_being_killed_and_puts_the_policy_back(postgres, tmp_path):
    storage = postgres.create_database("fleet_restart")
    replica = Replica(None)
    port = int(replica.proc.address.rsplit(":", 1)[1])
    worker = None
    try:
        replica.load_on()
        worker = Worker(replica, storage, "worker-r", tmp_path, "--trials", "2", "--remeasure", "0", "--continuous",
                        "--connect-timeout", "2", study="restart")
        worker.wait_for("decision initial")
        incumbent = optuna.load_study(study_name="restart", storage=storage).user_attrs["continuous"]["incumbent"]
        wait_until(lambda: replica.client.get_policy().policy_id == incumbent["policy_id"], 60, what="incumbent")
        bound = float(worker.log().split("gets its policy back within ")[1].split(" s")[0])
        replica.load_off()
        old_instance = replica.client.model_info().instance_id
        replica.proc.process.send_signal(signal.SIGKILL)
        replica.proc.process.wait(10)
        time.sleep(3)  # down for longer than the worker's connect timeout
        restarted = start_server(telemetry_env(f"http://127.0.0.1:{replica.otlp_port}"), TOKEN, SERVE, port=port)
        replica.proc = restarted
        came_back = time.monotonic()
        # The worker's policy, not the start-up one: its incumbent, or the arms of a challenge round
        # that began meanwhile (both carry the study's policy ids).
        wait_until(lambda: replica.client.get_policy().policy_id.startswith("restart"), bound + 5,
                   what="the worker's policy back on the restarted server")
        took = time.monotonic() - came_back
        assert took <= bound + 1, took
        # Whichever call reached the restarted server first (the idle check re-applying the incumbent,
        # or a challenge's own SetTrafficSplit), the worker follows its new instance id.
        assert worker.proc.poll() is None, worker.log()
        assert replica.client.model_info().instance_id != old_instance
        worker.wait_for(f"spans counted from instance {replica.client.model_info().instance_id}")
    finally:
        if worker is not None:
            worker.stop()
        replica.close()


@pytest.mark.parametrize("url", [
    "postgresql+psycopg2://moespec@127.0.0.1:{closed}/x",
    "postgresql+nosuchdriver://moespec@127.0.0.1:{port}/postgres",
    "postgresql+psycopg2://moespec@127.0.0.1:{port}/no_such_database",
])
def test_bad_postgresql_storage_urls_exit_2_with_one_line(postgres, url):
    storage = url.format(closed=free_port(), port=postgres.port)
    result = subprocess.run([*MOESPEC, "tune", "--server", "127.0.0.1:1", "--otlp-listen", f"127.0.0.1:{free_port()}",
                             "--storage", storage], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("moespec tune: error:"), result.stderr


def _open_together(url: str, openers: int) -> list[BaseException]:
    """`openers` threads open the storage at `url` at the same instant -> the errors they raised."""
    start = threading.Barrier(openers)
    errors: list[BaseException] = []

    def open_one() -> None:
        start.wait()
        try:
            st.open_storage(url)
        except BaseException as e:  # noqa: BLE001 (collected and asserted by the caller)
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(openers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def test_workers_opening_a_fresh_database_together_all_get_the_storage(postgres):
    """Fleet workers start together: on a fresh database each one's first open creates Optuna's
    schema, and PostgreSQL answers all but one with a unique violation on its catalog. Every open
    must still succeed (a peer made the schema), on several fresh databases in a row."""
    for round_ in range(3):
        url = postgres.create_database(f"schema_race_{round_}")
        errors = _open_together(url, openers=6)
        assert not errors, [str(e) for e in errors]
        assert st.open_study(st.open_storage(url), "race", optuna.samplers.RandomSampler(), "measured")
