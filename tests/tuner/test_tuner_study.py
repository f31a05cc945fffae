"""Study handling, the search space, the sampler choice and the pruning rule (no server needed)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import optuna
import pytest
from optuna.trial import TrialState

from service.types import Drafter, DraftPolicy
from tests.support.tuner_fixtures import model_info
from tuner.loop import study as st
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, make_sampler, temperature_step
from tuner.loop.space import SearchSpace, policy_key

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def space() -> SearchSpace:
    return SearchSpace.from_model_info(model_info())


def new_study(tmp_path, name="s", objective="measured"):
    storage = st.open_storage(f"sqlite:///{tmp_path / 'tuner.db'}")
    return storage, st.open_study(storage, name, optuna.samplers.RandomSampler(seed=0), objective)


# -- storage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["not-a-url", "nosuchdialect://x/y", "sqlite:////nonexistent-dir/sub/t.db",
                                 "journal:"])
def test_bad_storage_url_is_a_storage_error_with_a_reason(url):
    with pytest.raises(st.StorageError, match=r"\S"):
        st.open_storage(url)


def test_journal_storage_works_and_resumes(tmp_path):
    url = f"journal:{tmp_path / 'j.log'}"
    study = st.open_study(st.open_storage(url), "j", optuna.samplers.RandomSampler(), "measured")
    study.tell(study.ask(), 1.0)
    again = st.open_study(st.open_storage(url), "j", optuna.samplers.RandomSampler(), "measured")
    assert [t.value for t in again.trials] == [1.0]


def test_study_for_the_other_objective_is_refused(tmp_path):
    storage, _ = new_study(tmp_path, objective="measured")
    with pytest.raises(st.StudyMismatch, match="measured"):
        st.open_study(storage, "s", optuna.samplers.RandomSampler(), "modelled")


# -- search space --------------------------------------------------------------------------------


def test_space_follows_model_info():
    s = SearchSpace.from_model_info(model_info(max_draft_length=5, drafters=(Drafter.NGRAM,),
                                               tunable=("draft_length",)))
    assert (s.max_draft_length, s.drafters, s.tune_drafter, s.tune_temperature) == (5, (Drafter.NGRAM,), False, False)
    assert all(p.draft_length == 0 or p.drafter is Drafter.NGRAM for p in s.grid((0.0, 1.0)))


def test_space_is_conditional(space):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        policy = space.suggest(trial, "p")
        if policy.draft_length == 0:
            assert set(trial.params) == {"draft_length"}
        elif policy.drafter is Drafter.NGRAM:
            assert set(trial.params) == {"draft_length", "drafter"}
        elif policy.draft_temperature == 0:  # greedy drafts: no temperature asked
            assert trial.params["draft_greedy"] is True
            assert set(trial.params) == {"draft_length", "drafter", "draft_greedy"}
        else:
            assert set(trial.params) == {"draft_length", "drafter", "draft_greedy", "draft_temperature"}
        assert space.policy_from_params(trial.params, "p") == policy
        study.tell(trial, 1.0)
        seen.add((policy.drafter, policy.draft_temperature == 0))
    assert {(Drafter.MODEL, True), (Drafter.MODEL, False)} <= seen  # both branches of draft_greedy came up


def test_greedy_drafts_are_a_point_a_search_can_hold_and_enqueue():
    """With a continuous temperature, T = 0 has no mass unless it is a point of its own: a sampler
    that knows greedy won keeps asking it (TPE over its history), and an enqueued greedy policy
    round-trips; a stored trial without draft_greedy (an older study) reads as sampled."""
    space = SearchSpace.from_model_info(model_info())
    greedy = DraftPolicy(Drafter.MODEL, 4, 0.0, policy_id="p")
    assert space.params_of(greedy) == {"draft_length": 4, "drafter": "model", "draft_greedy": True}
    assert space.policy_from_params(space.params_of(greedy), "p") == greedy
    assert space.policy_from_params({"draft_length": 4, "drafter": "model", "draft_temperature": 0.3}, "p") == \
        DraftPolicy(Drafter.MODEL, 4, 0.3, policy_id="p")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True,
                                                                 group=True))
    for _ in range(40):
        trial = study.ask()
        policy = space.suggest(trial, "")
        # The landscape of the shipped pair under greedy load: greedy drafts best, cost up with T.
        cost = 1.0 if policy.draft_length == 0 or policy.drafter is Drafter.NGRAM else \
            0.5 + policy.draft_temperature + 0.02 * abs(policy.draft_length - 6)
        study.tell(trial, cost)
    best = space.policy_from_params(study.best_trial.params, "")
    assert best.drafter is Drafter.MODEL and best.draft_temperature == 0.0


def test_grid_mode_enqueues_every_point_of_the_discrete_space_once(space):
    grid_space = SearchSpace.from_model_info(model_info(), temperature_step=temperature_step(SamplerKind.GRID))
    points = [policy_key(p) for p in initial_policies(SamplerKind.GRID, grid_space, InitialDesign.CORNERS)]
    assert len(points) == len(set(points)) == 1 + 8 + 8 * 4  # plain, n-gram x k, model x k x {0,.5,1,1.5}
    assert {policy_key(p) for p in space.baselines()} <= set(points)
    study = optuna.create_study(sampler=make_sampler(SamplerKind.GRID, seed=0, n_trials=41))
    for p in initial_policies(SamplerKind.GRID, grid_space, InitialDesign.CORNERS):
        study.enqueue_trial(grid_space.params_of(p))
    for _ in points:
        trial = study.ask()
        grid_space.suggest(trial, "")
        study.tell(trial, 1.0)
    assert [policy_key(grid_space.policy_from_params(t.params, "")) for t in study.trials] == points


def joint_space_after_history(sampler: optuna.samplers.BaseSampler, space: SearchSpace) -> set[str]:
    """The parameters `sampler` would model jointly (Optuna's public `infer_relative_search_space`)
    after a history holding all three branches of the conditional space: plain decoding (length
    only), n-gram (length, drafter) and the model drafter (length, drafter, greedy or not,
    temperature)."""
    study = optuna.create_study(sampler=sampler)
    for policy in (DraftPolicy(Drafter.MODEL, 0), DraftPolicy(Drafter.NGRAM, 3), DraftPolicy(Drafter.MODEL, 3, 0.5),
                   DraftPolicy(Drafter.NGRAM, 5), DraftPolicy(Drafter.MODEL, 2, 1.0)):
        study.enqueue_trial(space.params_of(policy))
        trial = study.ask()
        space.suggest(trial, "")
        study.tell(trial, float(policy.draft_length))
    return set(sampler.infer_relative_search_space(study, study.trials[-1]))


def test_default_sampler_is_multivariate_grouped_tpe(space):
    # Multivariate: parameters are modelled jointly (an independent TPE infers no joint space).
    # Grouped: the conditional temperature and drafter join the model although plain-decoding trials
    # lack them (an ungrouped multivariate TPE keeps only the parameters every trial has).
    everything = {"draft_length", "drafter", "draft_greedy", "draft_temperature"}
    assert joint_space_after_history(make_sampler(SamplerKind.TPE, seed=0, n_trials=30), space) == everything
    # Negative controls: the check tells the two settings apart on the real sampler.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        independent = optuna.samplers.TPESampler(seed=0, multivariate=False)
        ungrouped = optuna.samplers.TPESampler(seed=0, multivariate=True, group=False)
    assert joint_space_after_history(independent, space) == set()
    assert joint_space_after_history(ungrouped, space) == {"draft_length"}


def test_corners_span_every_axis_and_follow_what_is_tunable(space):
    labels = [policy_key(p).label() for p in initial_policies(SamplerKind.TPE, space, InitialDesign.CORNERS)]
    assert labels == ["plain", "model k=8 T=0.00", "ngram k=8", "model k=2 T=0.00", "ngram k=2"]
    for p in space.corners():
        assert space.contains(p) and space.policy_from_params(space.params_of(p), "") == replace(p, policy_id="")
    length_only = SearchSpace.from_model_info(model_info(max_draft_length=1, drafters=(Drafter.NGRAM,),
                                                         tunable=("draft_length",)))
    assert [policy_key(p).label() for p in length_only.corners()] == ["plain", "ngram k=1"]
    no_temperature = SearchSpace.from_model_info(model_info(tunable=("draft_length", "drafter")))
    assert "model k=8 T=1.00" in [policy_key(p).label() for p in no_temperature.corners()]
    assert initial_policies(SamplerKind.TPE, space, InitialDesign.NONE) == []


def test_baselines_are_plain_default_and_ngram(space):
    labels = [policy_key(p).label() for p in space.baselines()]
    assert labels == ["plain", "model k=3 T=1.00", "ngram k=3"]
    default = space.baselines()[1]
    assert space.policy_from_params(space.params_of(default), default.policy_id) == default


# -- resume after a crash ------------------------------------------------------------------------


def test_recovery_fails_own_and_stale_running_trials_and_keeps_finished_ones(tmp_path):
    storage, study = new_study(tmp_path)
    done = study.ask()
    study.tell(done, 0.5)
    mine = study.ask()
    mine.set_user_attr("tuner_id", "me")
    mine.set_user_attr("heartbeat", 1000.0)
    other_live = study.ask()
    other_live.set_user_attr("tuner_id", "other")
    other_live.set_user_attr("heartbeat", 1000.0)
    other_dead = study.ask()
    other_dead.set_user_attr("tuner_id", "other2")
    other_dead.set_user_attr("heartbeat", 800.0)

    failed = st.recover_interrupted(storage, study, "me", grace_seconds=60, now=1010.0)

    assert failed == [mine.number, other_dead.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.FAIL, 2: TrialState.RUNNING, 3: TrialState.FAIL}
    assert study.trials[1].user_attrs["fail_reason"] == st.FAIL_INTERRUPTED
    assert study.trials[0].value == 0.5


def test_interrupted_and_starved_trials_do_not_count_towards_the_budget(tmp_path):
    storage, study = new_study(tmp_path)
    study.tell(study.ask(), 1.0)
    t = study.ask()
    t.set_user_attr("tuner_id", "me")
    st.recover_interrupted(storage, study, "me", 60, 0)
    starved = study.ask()
    starved.set_user_attr("fail_reason", "starved: 0 tokens / 0 steps / 0 requests in 60.0 s")
    study.tell(starved, state=TrialState.FAIL)
    assert st.search_trials_done(study) == 1  # a window without traffic measured nothing: redone
    # Nor did a trial whose server went away, or whose policy another fleet worker was measuring.
    for reason in ("server unreachable: down", "busy: plain is being measured by w2 trial 7"):
        other = study.ask()
        other.set_user_attr("fail_reason", reason)
        study.tell(other, state=TrialState.FAIL)
    assert st.search_trials_done(study) == 1
    failed = study.ask()
    failed.set_user_attr("fail_reason", "admin token refused")
    study.tell(failed, state=TrialState.FAIL)
    assert st.search_trials_done(study) == 2


# -- incumbent and winner ------------------------------------------------------------------------


def add(study, space, policy: DraftPolicy, value: float, role=st.ROLE_SEARCH):
    study.enqueue_trial(space.params_of(policy), user_attrs={"role": role})
    trial = study.ask()
    space.suggest(trial, "")
    study.tell(trial, value)


def test_incumbent_is_the_best_mean_and_a_remeasurement_can_dethrone_it(tmp_path, space):
    _, study = new_study(tmp_path)
    lucky = DraftPolicy(Drafter.MODEL, 3, 1.0)
    steady = DraftPolicy(Drafter.NGRAM, 4)
    add(study, space, DraftPolicy(), 1.0)
    add(study, space, lucky, 0.5)
    add(study, space, steady, 0.6)
    assert policy_key(st.incumbent(study, space).policy) == policy_key(lucky)
    assert st.incumbent(study, space).policy.policy_id == "s/1"
    add(study, space, lucky, 0.9, role=st.ROLE_REMEASURE)  # the 0.5 was noise
    add(study, space, steady, 0.62, role=st.ROLE_REMEASURE)
    best = st.winner(study, space, top=2)
    assert policy_key(best.policy) == policy_key(steady)
    assert best.values == (0.6, 0.62) and best.mean == pytest.approx(0.61)


def add_paired(study, space, policy: DraftPolicy, ratio: float, control: DraftPolicy, control_value: float,
               role=st.ROLE_SEARCH):
    """A paired trial as the tuner tells it: value = ratio x the control's value."""
    study.enqueue_trial(space.params_of(policy), user_attrs={"role": role})
    trial = study.ask()
    space.suggest(trial, "")
    trial.set_user_attr("paired_ratio", ratio)
    trial.set_user_attr("control_policy", policy_key(control).label())
    study.tell(trial, ratio * control_value)


def test_confirmation_picks_by_direct_ratios_not_by_chained_values(tmp_path, space):
    """A search chain: n-gram k=4 at 0.9x plain, then model k=2 T=0 at a lucky 0.7x n-gram k=4 (its
    chained value 0.63 makes it the incumbent). The confirmation pairs the others with it directly:
    n-gram k=4 measures 0.95x it, i.e. cheaper. The confirmed winner is n-gram k=4; the mean-of-values
    rule (the negative control, used for sequential trials) keeps the lucky chain's end."""
    _, study = new_study(tmp_path)
    plain, ngram, model = DraftPolicy(), DraftPolicy(Drafter.NGRAM, 4), DraftPolicy(Drafter.MODEL, 2, 0.0)
    add(study, space, plain, 1.0)
    add_paired(study, space, ngram, 0.9, plain, 1.0)
    add_paired(study, space, model, 0.7, ngram, 0.9)
    assert policy_key(st.incumbent(study, space).policy) == policy_key(model)
    add_paired(study, space, ngram, 0.95, model, 0.63, role=st.ROLE_REMEASURE)
    add_paired(study, space, plain, 1.2, model, 0.63, role=st.ROLE_REMEASURE)
    best, confirmation = st.confirmed_winner(study, space, top=3)
    assert policy_key(best.policy) == policy_key(ngram)
    assert confirmation == {"ngram k=4": 0.95, "model k=2 T=0.00": 1.0, "plain": 1.2}
    assert policy_key(st.winner(study, space, top=3).policy) == policy_key(model)  # negative control
    # Confirmations against another control do not count: then the search's incumbent stands.
    _, other = new_study(tmp_path, name="other")
    add(other, space, plain, 1.0)
    add_paired(other, space, ngram, 0.9, plain, 1.0)
    add_paired(other, space, model, 0.7, ngram, 0.9)
    add_paired(other, space, ngram, 0.5, plain, 1.0, role=st.ROLE_REMEASURE)
    best, confirmation = st.confirmed_winner(other, space, top=3)
    assert confirmation is None and policy_key(best.policy) == policy_key(model)


def test_remeasure_candidates_use_search_trials_only(tmp_path, space):
    _, study = new_study(tmp_path)
    add(study, space, DraftPolicy(), 1.0)
    add(study, space, DraftPolicy(Drafter.NGRAM, 2), 2.0)
    add(study, space, DraftPolicy(Drafter.NGRAM, 2), 0.1, role=st.ROLE_REMEASURE)
    assert [c.key.label() for c in st.remeasure_candidates(study, space, 1)] == ["plain"]
    assert st.remeasured(study, space) == {policy_key(DraftPolicy(Drafter.NGRAM, 2)): 1}


# -- pruning rule --------------------------------------------------------------------------------


def test_prune_only_when_far_worse_after_enough_of_the_window():
    rule = PruneRule(factor=1.5, min_fraction=0.25)
    kw = dict(min_tokens=100, min_steps=20)
    assert not rule.should_prune(10.0, tokens=10, steps=10, incumbent=1.0, **kw)  # too early to judge
    assert rule.should_prune(1.6, tokens=25, steps=5, incumbent=1.0, **kw)
    assert not rule.should_prune(1.4, tokens=100, steps=20, incumbent=1.0, **kw)  # worse, not far worse
    assert not rule.should_prune(9.0, tokens=100, steps=20, incumbent=None, **kw)  # no incumbent yet
    assert not PruneRule(factor=0).should_prune(9.0, tokens=100, steps=20, incumbent=1.0, **kw)  # disabled
