"""The tuning loop against a fake policy server with synthetic traffic: fast checks of the online
safety rules (prune + restore, FAIL on starved windows, re-apply after a restart, resume)."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from service.types import Drafter, DraftPolicy
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic
from tuner.loop import study as st
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.events import EventKind
from tuner.loop.pruning import PruneRule
from tuner.loop.space import policy_key
from tuner.loop.tuning import NoTraffic
from tuner.measurement.admin import PolicyAdmin, ServerUnavailable
from tuner.measurement.collector import SpanCollector
from tuner.measurement.measure import TrialMode
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)

FAST_WINDOW = WindowSpec(min_tokens=64, min_steps=8, max_seconds=0.5)


def settings(**kw) -> TuneSettings:
    base = dict(study_name="s", trials=6, tuner_id="t1", seed=0, window=FAST_WINDOW, remeasure_top=2,
                poll_seconds=0.01, policy_check_seconds=0.02, stale_seconds=60)
    base.update(kw)
    return TuneSettings(**base)


def cost(policy: DraftPolicy) -> float:
    """Synthetic landscape: n-gram k=4 is best, the model drafter is expensive, plain is 1.0."""
    if policy.draft_length == 0:
        return 1.0
    if policy.drafter is Drafter.NGRAM:
        return 0.6 + 0.05 * abs(policy.draft_length - 4)
    return 2.0 + policy.draft_temperature


def build(tmp_path, server: FakeServer, on_event=lambda e: None, **kw):
    storage = st.open_storage(f"sqlite:///{tmp_path / 't.db'}")
    collector = SpanCollector(request_sample)
    admin = PolicyAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None)
    return assemble(settings(**kw), storage, admin, collector, on_event), collector, storage


def test_small_budget_stores_valued_trials_with_attrs_and_applies_the_winner(tmp_path):
    server = FakeServer()
    events = []
    built, collector, _ = build(tmp_path, server, events.append, trials=6)
    with SyntheticTraffic(server, collector.on_spans, cost):
        best = built.tuner.run()
    trials = built.study.get_trials()
    assert st.search_trials_done(built.study) == 6  # measured ones; re-proposals come on top, free
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    assert complete and all(t.value > 0 and "acceptance_rate" in t.user_attrs for t in complete)
    remeasured = [t for t in trials if t.user_attrs["role"] == st.ROLE_REMEASURE]
    assert 1 <= len(remeasured) <= 2  # the top two, less the incumbent (the control of the others)
    assert trials[0].user_attrs["trial_mode"] == "sequential"  # the first sets the scale
    assert all(t.user_attrs["trial_mode"] == "paired" for t in complete[1:] if "duplicate_of" not in t.user_attrs)
    assert server.policy == best.policy and server.policy.policy_id == f"s/{best.trials[0]}"
    assert built.study.user_attrs["winner"]["policy_id"] == server.policy.policy_id
    # The baselines went first, and the best policy was applied between trials.
    assert [policy_key(p).label() for p in server.history[:1]] == ["plain"]
    assert any(e.kind is EventKind.INCUMBENT for e in events)


def test_a_policy_asked_again_reuses_its_result_without_measuring(tmp_path):
    from tests.support.tuner_fixtures import model_info

    server = FakeServer(model_info(max_draft_length=1, drafters=(Drafter.NGRAM,), tunable=("draft_length",)))
    events = []
    built, collector, _ = build(tmp_path, server, events.append, trials=5, remeasure_top=0,
                                max_consecutive_duplicates=3)
    with SyntheticTraffic(server, collector.on_spans, cost):
        built.tuner.run()
    search = built.study.trials
    copies = [t for t in search if "duplicate_of" in t.user_attrs]
    # Only two distinct policies exist (plain, ngram k=1): re-proposals do not count towards the
    # budget of 5, and three in a row end the search as converged instead of looping.
    assert st.search_trials_done(built.study) == 2 and len(copies) == 3
    assert [e.kind for e in events].count(EventKind.CONVERGED) == 1
    measured = {t.number for t in search} - {t.number for t in copies}
    applied_trials = {p.policy_id for p in server.history} | {
        a.policy.policy_id for split in server.splits for a in split.arms}
    assert applied_trials >= {f"s/{n}" for n in measured}
    assert not applied_trials & {f"s/{t.number}" for t in copies}
    for t in copies:
        original = built.study.trials[t.user_attrs["duplicate_of"]]
        assert t.state is original.state and t.params == original.params


def test_trial_far_worse_than_incumbent_is_pruned_and_incumbent_restored(tmp_path):
    server = FakeServer()
    built, collector, _ = build(tmp_path, server, trials=2, prune=PruneRule(factor=1.5, min_fraction=0.25),
                                window=WindowSpec(min_tokens=400, min_steps=8, max_seconds=5),
                                trial_mode=TrialMode.SEQUENTIAL)
    with SyntheticTraffic(server, collector.on_spans, cost):
        built.tuner.run()
    plain, default = built.study.trials[:2]
    assert plain.state is TrialState.COMPLETE
    assert default.state is TrialState.PRUNED  # model k=3 T=1.0 costs 3x plain
    assert "incumbent" in default.user_attrs["prune_reason"]
    assert default.user_attrs["committed_tokens"] < 400  # stopped before its window was full
    assert default.intermediate_values  # samplers still learn from it
    after = server.history[server.history.index(DraftPolicy(Drafter.MODEL, 3, 1.0, "s/1")) + 1]
    assert after.policy_id == "s/0"  # restored at once


def test_window_without_traffic_fails_and_the_tuner_stops_with_a_diagnosis(tmp_path):
    server = FakeServer()
    built, _, _ = build(tmp_path, server, trials=5, max_consecutive_failures=2,
                        window=WindowSpec(min_tokens=10, min_steps=1, max_seconds=0.1))
    with pytest.raises(NoTraffic, match="no request spans reached the tuner"):
        built.tuner.run()
    trials = built.study.get_trials(states=(TrialState.FAIL, TrialState.COMPLETE, TrialState.PRUNED))
    assert [t.state for t in trials] == [TrialState.FAIL] * 2
    assert all(t.value is None and t.user_attrs["fail_reason"].startswith("starved") for t in trials)


def test_server_restart_mid_trial_gets_the_policy_reapplied(tmp_path):
    server = FakeServer()
    restarted = []

    def restart_once(event):
        if event.kind is EventKind.TRIAL_PROGRESS and not restarted:
            server.restart()
            restarted.append(event.trial)

    built, collector, _ = build(tmp_path, server, restart_once, trials=1, remeasure_top=0,
                                window=WindowSpec(min_tokens=300, min_steps=8, max_seconds=5))
    with SyntheticTraffic(server, collector.on_spans, cost):
        built.tuner.run()
    trial = built.study.trials[0]
    assert trial.state is TrialState.COMPLETE and trial.user_attrs["policy_reapplied"] >= 1


def test_restart_fails_the_interrupted_trial_keeps_finished_ones_and_reapplies_incumbent(tmp_path):
    server = FakeServer()
    built, collector, storage = build(tmp_path, server, trials=2, remeasure_top=0)
    with SyntheticTraffic(server, collector.on_spans, cost):
        built.tuner.run()
    finished = {t.number: t.value for t in built.study.trials}
    incumbent_id = st.incumbent(built.study, built.space).policy.policy_id
    # A tuner with our id was killed mid-trial: its trial is still RUNNING in storage.
    orphan = built.study.ask()
    orphan.set_user_attr("tuner_id", "t1")
    orphan.set_user_attr("role", st.ROLE_SEARCH)
    server.history.clear()

    again, collector2, _ = build(tmp_path, server, trials=3, remeasure_top=0)
    assert again.study.trials[orphan.number].state is TrialState.RUNNING
    with SyntheticTraffic(server, collector2.on_spans, cost):
        again.tuner.run()
    trials = again.study.trials
    assert trials[orphan.number].state is TrialState.FAIL
    assert trials[orphan.number].user_attrs["fail_reason"] == st.FAIL_INTERRUPTED
    assert {n: trials[n].value for n in finished} == finished
    assert server.history[0].policy_id == incumbent_id  # re-applied before anything else
    assert st.search_trials_done(again.study) == 3  # the interrupted one did not count


def test_unreachable_server_at_start_raises_before_touching_the_study(tmp_path):
    server = FakeServer()
    built, _, _ = build(tmp_path, server, trials=2)
    server.down = True
    with pytest.raises(ServerUnavailable, match="no answer from fake:0"):
        built.tuner.run()
    assert built.study.trials == []


def test_server_gone_mid_run_fails_the_trial_and_raises(tmp_path):
    server = FakeServer()

    def down_at_trial_1(event):
        if event.kind is EventKind.TRIAL_STARTED and event.trial == 1:
            server.down = True

    built, collector, _ = build(tmp_path, server, down_at_trial_1, trials=3)
    with SyntheticTraffic(server, collector.on_spans, cost), pytest.raises(ServerUnavailable):
        built.tuner.run()
    trials = built.study.trials
    assert trials[0].state is TrialState.COMPLETE
    assert trials[1].state is TrialState.FAIL and trials[1].user_attrs["fail_reason"].startswith("server unreachable")


def test_a_server_that_answers_again_after_being_unreachable_is_followed_as_restarted():
    """A restart caught by a challenge's own SetTrafficSplit (no `ensure` finds our policy missing
    afterwards) must still reach `on_server_changed`: the new instance id is whose spans count."""
    server = FakeServer()
    changed = []

    def back_up(seconds):
        server.down = False  # the server restarts while the call retries

    admin = PolicyAdmin(server, "fake:0", retry_seconds=5, sleep=back_up, on_server_changed=lambda: changed.append(1))
    admin.current()
    assert changed == []  # reachable all along: nothing to follow
    server.down = True
    admin.apply(DraftPolicy(Drafter.NGRAM, 4, policy_id="ours"))
    assert changed == [1]
    assert not admin.ensure(DraftPolicy(Drafter.NGRAM, 4, policy_id="ours")) and changed == [1]
