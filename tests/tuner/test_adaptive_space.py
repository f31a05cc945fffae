"""The search space with the moespec rule (`adaptive`) and with tables by request kind (`by_kind`):
conditional, round-tripping through Optuna's params, refused where the server cannot run it; a
grid search over tables finds the table a synthetic landscape makes best (the static policies
stay in the space as the special case)."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from service.types import Controller, Drafter, DraftPolicy, RequestKind
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic, model_info, sample_space
from tuner.loop import study as st
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, temperature_step
from tuner.loop.space import COST_WEIGHT_RANGE, SearchSpace, by_kind, kind_parts, policy_key
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample
from tuner.measurement.window import WindowSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)
ADAPTIVE_INFO = model_info(controllers=tuple(Controller), policy_tables=True)


def sample(space: SearchSpace, n: int = 120) -> list[tuple[dict, DraftPolicy]]:
    return sample_space(space, n, seed=3)


def test_the_adaptive_space_asks_the_rule_and_its_weight_only_where_they_matter():
    space = SearchSpace.from_model_info(ADAPTIVE_INFO, adaptive=True)
    controllers = set()
    for params, policy in sample(space):
        assert space.policy_from_params(params, "p") == policy
        assert space.policy_from_params(space.params_of(policy), "p") == policy
        assert ("controller" in params) == (policy.draft_length > 0)
        assert ("cost_weight" in params) == (policy.controller is Controller.MOESPEC)
        if policy.controller is Controller.MOESPEC:
            assert COST_WEIGHT_RANGE[0] <= policy.cost_weight <= COST_WEIGHT_RANGE[1]
        assert space.contains(policy)
        controllers.add(policy.controller)
    assert controllers == {Controller.STATIC, Controller.MOESPEC}  # static stays the special case


def test_the_by_kind_space_asks_one_part_per_kind_and_builds_a_table():
    space = SearchSpace.from_model_info(ADAPTIVE_INFO, adaptive=True, by_kind=True)
    pairs = set()
    for params, policy in sample(space):
        assert space.policy_from_params(params, "p") == policy and policy.policy_id == "p"
        assert [(c.kind, c.min_batch, c.max_batch) for c in policy.cells] == [(RequestKind.GREEDY, 1, 0)]
        assert {k.split(".")[0] for k in params} == {"greedy", "sampled"}
        greedy, sampled = kind_parts(policy)
        assert policy.for_step(5, greedy=True)[1] == greedy and policy.for_step(5, greedy=False)[1] == policy
        pairs.add((greedy.draft_length > 0, sampled.draft_length > 0))
    assert pairs == {(True, True), (True, False), (False, True), (False, False)}
    # A policy without cells, enqueued into a space of tables, is the table that runs it for both kinds.
    ngram = DraftPolicy(Drafter.NGRAM, 4, policy_id="p")
    assert space.policy_from_params(space.params_of(ngram), "p") == by_kind(ngram, ngram, "p")


def test_a_server_without_the_rule_or_tables_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="moespec controller.*EAGLE"):
        SearchSpace.from_model_info(model_info(controllers_note="needs EAGLE"), adaptive=True)
    with pytest.raises(ValueError, match="policy_tables"):
        SearchSpace.from_model_info(model_info(controllers=tuple(Controller)), by_kind=True)


def test_the_grid_holds_every_static_point_and_each_under_the_rule():
    space = SearchSpace.from_model_info(ADAPTIVE_INFO, temperature_step=temperature_step(SamplerKind.GRID),
                                        adaptive=True)
    keys = [policy_key(p) for p in initial_policies(SamplerKind.GRID, space, InitialDesign.CORNERS)]
    static = 1 + 8 + 8 * 4  # plain, n-gram x k, model x k x {0,.5,1,1.5}
    assert len(keys) == len(set(keys)) == static + (static - 1) * 3  # each drafting point at 3 weights
    assert sum(k.controller == "static" for k in keys) == static


def landscape(policy: DraftPolicy) -> float:
    """Greedy requests gain from n-gram drafts (k=2 best), sampled ones lose: the best table drafts
    n-gram k=2 for greedy requests and nothing for sampled ones; every static policy is worse."""
    greedy, sampled = kind_parts(policy)
    return 0.5 * {0: 1.0, 1: 0.7, 2: 0.4}[greedy.draft_length] + 0.5 * {0: 1.0, 1: 1.4, 2: 1.8}[sampled.draft_length]


def test_a_grid_search_over_tables_picks_the_table_the_landscape_makes_best(tmp_path):
    server = FakeServer(model_info(max_draft_length=2, drafters=(Drafter.NGRAM,), tunable=("draft_length",),
                                   controllers=tuple(Controller), policy_tables=True))
    settings = TuneSettings(study_name="s", trials=9, tuner_id="t1", seed=0, sampler=SamplerKind.GRID,
                            window=WindowSpec(min_tokens=64, min_steps=8, max_seconds=0.5), remeasure_top=2,
                            poll_seconds=0.01, policy_check_seconds=0.02, by_kind=True)
    collector = SpanCollector(request_sample)
    built = assemble(settings, st.open_storage(f"sqlite:///{tmp_path / 't.db'}"),
                     PolicyAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None), collector)
    with SyntheticTraffic(server, collector.on_spans, landscape, noise=0.02):
        best = built.tuner.run()
    measured = {policy_key(built.space.policy_from_params(t.params, "")) for t in built.study.get_trials()
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    assert len(measured) == 9  # every pair of {plain, k1, k2} (pruned: far worse than the incumbent)
    greedy, sampled = kind_parts(best.policy)
    assert (greedy.drafter, greedy.draft_length, sampled.draft_length) == (Drafter.NGRAM, 2, 0)
    assert server.policy.cells and server.policy == best.policy  # the table runs on the server
