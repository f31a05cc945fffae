"""Continuous mode against a fake server with synthetic traffic: it moves to the new best after a
synthetic workload shift, stays put when nothing changes, and a restart keeps a promoted incumbent."""

from __future__ import annotations

import threading
import time

import optuna
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel import attributes as a
from service.types import Drafter, DraftPolicy
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic
from tests.tuner.test_tuner_loop import settings
from tuner.loop import study as st
from tuner.loop.assemble import assemble
from tuner.loop.continuous import ContinuousTuner, idle_floor
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.metrics import TunerMetrics
from tuner.loop.promotion import PromotionGate
from tuner.loop.shift import ShiftDetector
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowSpec, WindowStats

optuna.logging.set_verbosity(optuna.logging.WARNING)

WINDOW = WindowSpec(min_tokens=64, min_steps=8, max_seconds=3)
FAST = ContinuousConfig(exploration_share=0.25, reopen_trials=6, idle_seconds=0.01, max_idle_seconds=0.02)


def code_workload(policy: DraftPolicy) -> float:
    """Before the shift: n-gram lookup shines (k=4 best), the model drafter is expensive."""
    if policy.draft_length == 0:
        return 1.0
    if policy.drafter is Drafter.NGRAM:
        return 0.6 + 0.05 * abs(policy.draft_length - 4)
    return 2.0 + policy.draft_temperature


def prose_workload(policy: DraftPolicy) -> float:
    """After the shift: nothing repeats, n-gram proposals are wasted; plain is best."""
    if policy.draft_length == 0:
        return 1.0
    if policy.drafter is Drafter.NGRAM:
        return 1.6 + 0.05 * policy.draft_length
    return 2.0 + policy.draft_temperature


class Harness:
    def __init__(self, tmp_path, server: FakeServer, metrics: TunerMetrics | None = None,
                 window: WindowSpec = WINDOW, config: ContinuousConfig = FAST):
        self.storage = st.open_storage(f"sqlite:///{tmp_path / 'c.db'}")
        self.collector = SpanCollector(request_sample)
        self.admin = PolicyAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None)
        self.decisions = []
        self.logs: list[str] = []
        base = settings(trials=6, remeasure_top=1, window=window, seed=3)
        root = assemble(base, self.storage, self.admin, self.collector)
        self.root = root

        def make(name: str, trials: int):
            if name == base.study_name:
                return root
            return assemble(settings(study_name=name, trials=trials, remeasure_top=1, window=window, seed=3),
                            self.storage, self.admin, self.collector)

        self.tuner = ContinuousTuner(root.study, make, config, base.trials, metrics, self.decisions.append,
                                     self.logs.append)

    def run_until(self, done, timeout: float) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self.tuner.run, args=(stop,), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
        stop.set()
        thread.join(30)
        assert not thread.is_alive()


def test_a_workload_shift_reopens_the_search_and_moves_to_the_new_best(tmp_path):
    server = FakeServer()
    workload = {"cost": code_workload}
    h = Harness(tmp_path, server)
    with SyntheticTraffic(server, h.collector.on_spans, lambda p: workload["cost"](p), noise=0.05):
        h.run_until(lambda: h.tuner.incumbent is not None and h.tuner.incumbent.policy.drafter is Drafter.NGRAM
                    and len(h.decisions) >= 1, timeout=60)
        assert h.tuner.incumbent.policy.drafter is Drafter.NGRAM  # code prompts: prompt lookup wins
        workload["cost"] = prose_workload
        h.run_until(lambda: any(d.kind == "reopen" for d in h.decisions)
                    and h.tuner.incumbent.policy.draft_length == 0, timeout=90)
    kinds = [d.kind for d in h.decisions]
    assert "reopen" in kinds, kinds
    assert h.tuner.incumbent.policy.draft_length == 0, h.decisions[-3:]
    assert server.policy.draft_length == 0  # what the server runs now
    root = h.tuner.built.study if h.tuner.epoch == 0 else optuna.load_study(study_name="s", storage=h.storage)
    assert [d["kind"] for d in root.user_attrs["decisions"]] == kinds
    assert root.user_attrs["continuous"]["epoch"] >= 1


def test_no_shift_keeps_the_incumbent_and_never_reopens(tmp_path):
    server = FakeServer()
    h = Harness(tmp_path, server)
    with SyntheticTraffic(server, h.collector.on_spans, code_workload, noise=0.05):
        h.run_until(lambda: sum(d.kind == "kept" for d in h.decisions) >= 6, timeout=90)
    kinds = [d.kind for d in h.decisions]
    assert kinds.count("kept") >= 6 and "reopen" not in kinds, kinds
    first = h.decisions[0].policy
    # Promotion among near-equal n-gram lengths is allowed only with confidence; the drafter stays.
    assert all(d.policy.startswith("ngram") for d in h.decisions), [d.policy for d in h.decisions]
    assert first.startswith("ngram")


def test_restart_keeps_the_saved_incumbent_and_publishes_it_as_a_metric(tmp_path):
    server = FakeServer()
    h = Harness(tmp_path, server)
    with SyntheticTraffic(server, h.collector.on_spans, code_workload, noise=0.05):
        h.run_until(lambda: len(h.decisions) >= 1, timeout=60)
    saved = h.tuner.built.study.user_attrs["continuous"]["incumbent"]
    # A decision the search's best-mean rule would not make: pretend a promotion picked n-gram k=6.
    promoted = DraftPolicy(Drafter.NGRAM, 6, 1.0, "s/promoted")
    h.tuner.built.study.set_user_attr("continuous", {**h.tuner.built.study.user_attrs["continuous"], "incumbent": {
        **saved, "params": {"draft_length": 6, "drafter": "ngram"}, "policy_id": "s/promoted", "label": "ngram k=6"}})
    server.restart()  # the server forgot everything meanwhile

    reader = InMemoryMetricReader()
    metrics = TunerMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), "s")
    again = Harness(tmp_path, server, metrics)
    with SyntheticTraffic(server, again.collector.on_spans, code_workload, noise=0.05):
        again.run_until(lambda: len(again.decisions) >= 1, timeout=60)
    assert again.decisions[0].kind == "initial" and "saved incumbent" in again.decisions[0].reason
    assert again.decisions[0].policy_id == "s/promoted"
    assert any(p == promoted for p in server.history)
    points = [(p.value, dict(p.attributes)) for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics if m.name == a.TUNER_INCUMBENT.name
              for p in m.data.data_points]
    assert points and points[-1][1][a.SPEC_POLICY_ID] == again.tuner.incumbent.policy.policy_id


@pytest.mark.parametrize("ratio, interval, first, second", [
    (1.65, (1.55, 1.75), False, False),  # the same as the baseline 1.67: no shift
    (1.10, (1.02, 1.19), True, True),  # a large move, old value outside: needs a second probe to agree
    (0.70, (0.62, 0.78), True, None),  # plain now cheaper with confidence: at once
    (1.20, (0.70, 1.90), False, False),  # moved, but too noisy to say (the old value is inside the interval)
], ids=["same", "moved", "plain-wins", "noisy"])
def test_plain_probe_shift_needs_a_confirmed_move_outside_the_interval(ratio, interval, first, second):
    d = ShiftDetector(ContinuousConfig(confirmations=2), plain_ratio=1.67, plain_probes=3)
    fired = d.observe_plain_probe(ratio, *interval) is not None
    if second is None:
        assert fired
        return
    assert not fired  # one signalling probe is not enough here
    assert (d.observe_plain_probe(ratio, *interval) is not None) is (first and second)


def test_plain_baseline_comes_from_probes_and_pools_the_quiet_ones():
    d = ShiftDetector(ContinuousConfig(confirmations=1))
    assert d.observe_plain_probe(1.6, 1.2, 2.1) is None and d.plain_ratio == pytest.approx(1.6)
    assert d.observe_plain_probe(1.4, 1.1, 1.8) is None  # inside the noise: pooled
    assert d.plain_ratio == pytest.approx((1.6 * 1.4) ** 0.5) and d.plain_probes == 2
    assert d.observe_plain_probe(0.7, 0.6, 0.8) is not None


def test_acceptance_shift_needs_consecutive_confirmations_and_enough_drafts():
    d = ShiftDetector(ContinuousConfig(confirmations=2), acceptance=0.6)
    assert d.observe_acceptance(0.2, drafted=10) is None  # too few drafts to judge
    assert d.observe_acceptance(0.2, drafted=500) is None  # one strike
    assert d.observe_acceptance(0.58, drafted=500) is None  # back to normal: strikes reset
    assert d.observe_acceptance(0.2, drafted=500) is None
    assert d.observe_acceptance(0.25, drafted=500) is not None


def test_after_an_interleaved_challenge_the_incumbent_serves_alone_long_enough_to_keep_the_share():
    from optuna.trial import TrialState

    from tuner.loop.trial import Challenge
    from tuner.measurement.measure import Measurement, Outcome, PairedMeasurement
    from tuner.measurement.paired import PairedRatio

    stats = WindowStats("x")
    m = Measurement(DraftPolicy(), Outcome.COMPLETE, stats, 1.0, seconds=6.0, reapplied=0)

    def challenge(share: float) -> Challenge:
        paired = PairedMeasurement(m, stats, DraftPolicy(), PairedRatio(1.0, 0.9, 1.1, 5, 5), share)
        return Challenge(1, DraftPolicy(), TrialState.COMPLETE, m, paired)

    assert idle_floor(challenge(0.1), 0.1) == 0.0  # a split at the exploration share bounds it already
    assert idle_floor(challenge(0.5), 0.1) == pytest.approx(54.0)  # 6 s of all traffic -> 54 s alone
    assert idle_floor(None, 0.1) == 0.0


def test_no_traffic_in_the_initial_search_waits_and_resumes_instead_of_exiting(tmp_path):
    """`moespec tune` stops with NoTraffic after three starved windows; continuous mode must not: it
    logs, backs off and resumes the same study once traffic arrives."""
    server = FakeServer()
    starving = WindowSpec(min_tokens=64, min_steps=8, max_seconds=0.3)
    h = Harness(tmp_path, server, window=starving,
                config=ContinuousConfig(exploration_share=0.25, idle_seconds=0.05, max_idle_seconds=0.2))
    with SyntheticTraffic(server, h.collector.on_spans, code_workload, noise=0.05) as traffic:
        traffic.paused.set()  # no requests at all
        stop = threading.Event()
        thread = threading.Thread(target=h.tuner.run, args=(stop,), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while sum("no traffic" in line for line in h.logs) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive(), h.logs  # did not exit on its own
        assert sum("no traffic" in line for line in h.logs) >= 2, h.logs  # kept waiting, and said so
        assert not h.decisions
        traffic.paused.clear()  # traffic arrives
        while not h.decisions and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    assert h.decisions and h.decisions[0].kind == "initial", h.logs
    study = h.root.study
    starved = [t for t in study.trials if str(t.user_attrs.get("fail_reason", "")).startswith(st.FAIL_STARVED)]
    assert len(starved) >= 6  # two waits of three starved windows each, none counted towards the budget
    assert st.search_trials_done(study) >= 6


def test_negative_control_the_same_starvation_stops_a_one_shot_search(tmp_path):
    """The condition the test above survives is real: the one-shot tuner on it raises NoTraffic."""
    from tuner.loop.tuning import NoTraffic

    server = FakeServer()
    h = Harness(tmp_path, server, window=WindowSpec(min_tokens=64, min_steps=8, max_seconds=0.3))
    with SyntheticTraffic(server, h.collector.on_spans, code_workload) as traffic:
        traffic.paused.set()
        with pytest.raises(NoTraffic):
            h.root.tuner.run()


def test_a_challenger_is_promoted_only_after_winning_rounds_in_a_row():
    """One confident win makes a challenger pending, not the incumbent: on a steady workload near-equal
    policies each win a round now and then (the no-shift benchmark promoted n-gram k=2 -> 1 -> 3 with a
    one-round rule). Negative control: confirmations=1 promotes on the first win."""
    k2, k3 = DraftPolicy(Drafter.NGRAM, 2, 1.0, "a"), DraftPolicy(Drafter.NGRAM, 3, 1.0, "b")
    gate = PromotionGate(confirmations=2)
    assert not gate.observe(k2, better=True) and gate.pending == k2
    assert not gate.observe(k2, better=False) and gate.pending is None  # lost its second look
    assert not gate.observe(k2, better=True)
    assert not gate.observe(k3, better=True) and gate.pending == k3 and gate.wins == 1  # another one starts over
    assert not gate.observe(DraftPolicy(Drafter.NGRAM, 3, 1.0, "c"), better=False) and gate.pending is None
    assert not gate.observe(k3, better=True)
    assert gate.observe(DraftPolicy(Drafter.NGRAM, 3, 1.0, "d"), better=True) and gate.pending is None
    assert PromotionGate(confirmations=1).observe(k2, better=True)


def test_a_better_challenger_is_challenged_again_at_once_and_then_promoted(tmp_path):
    """The saved incumbent is n-gram k=8 (0.8x plain on this workload); n-gram k=4 (0.6x) beats it. The
    round after its first confident win challenges it again (no plain probe or runner-up in between),
    and that second win promotes it."""
    server = FakeServer()
    h = Harness(tmp_path, server)
    with SyntheticTraffic(server, h.collector.on_spans, code_workload, noise=0.05):
        h.run_until(lambda: len(h.decisions) >= 1, timeout=60)
    study = h.tuner.built.study
    saved = study.user_attrs["continuous"]["incumbent"]
    # The shift baselines were the search winner's; a saved k=8 starts without them (else its own,
    # different, acceptance reads as a workload shift and re-opens the search instead).
    study.set_user_attr("continuous", {**study.user_attrs["continuous"], "plain_ratio": None, "plain_probes": 0,
                                       "acceptance": None, "incumbent": {
        **saved, "params": {"draft_length": 8, "drafter": "ngram"}, "policy_id": "s/k8", "label": "ngram k=8"}})
    again = Harness(tmp_path, server)
    with SyntheticTraffic(server, again.collector.on_spans, code_workload, noise=0.05):
        again.run_until(lambda: any(d.kind == "promote" for d in again.decisions), timeout=120)
    promote = next(i for i, d in enumerate(again.decisions) if d.kind == "promote")
    pending = again.decisions[promote - 1]
    assert pending.kind == "kept" and "measured again next" in pending.reason, [d.reason for d in again.decisions]
    challenger = pending.reason.split(" at ")[0].removeprefix("challenger ")
    assert again.decisions[promote].policy == challenger and "2 rounds in a row" in again.decisions[promote].reason
    assert again.tuner.incumbent.policy.draft_length < 8
    assert not any(d.kind == "reopen" for d in again.decisions[:promote])
