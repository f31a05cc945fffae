"""Draft trees in the tuner: the search space asks a tree width only where a tree can run (a server
that drafts trees and lists the knob, the model drafter, a draft length > 0, the static controller),
round-trips it through Optuna's params, and a search over a server that drafts trees finds the tree
its landscape makes best; whatever the tuner labels, claims and measures tells a tree from a chain."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from service.types import Controller, Drafter, DraftPolicy
from tests.support.tuner_fixtures import FakeServer, SyntheticTraffic, model_info, request_span, sample_space
from tuner.drivers.report import series_of, trial_rows
from tuner.loop import study as st
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.fleet import claim_key
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, temperature_step
from tuner.loop.space import LengthOnly, SearchSpace, policy_key
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import ran_policy, request_sample
from tuner.measurement.window import WindowSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)
TUNABLE = ("drafter", "draft_length", "draft_temperature", "tree_width")
TREE_INFO = model_info(tunable=TUNABLE, max_tree_width=3, controllers=tuple(Controller))


def sample(space: SearchSpace, n: int = 150) -> list[tuple[dict, DraftPolicy]]:
    return sample_space(space, n, seed=5)


def test_a_tree_width_is_asked_only_where_a_tree_can_run():
    space = SearchSpace.from_model_info(TREE_INFO, adaptive=True)
    widths = set()
    for params, policy in sample(space):
        policy.validate()  # never a tree the service refuses
        assert space.policy_from_params(params, "p") == policy
        assert space.policy_from_params(space.params_of(policy), "p") == policy
        assert ("tree_width" in params) == (policy.draft_length > 1 and policy.drafter is Drafter.MODEL)
        assert ("controller" in params) == (policy.draft_length > 0 and policy.tree_width == 1)
        assert space.contains(policy)
        widths.add(policy.tree_width)
    assert widths == {1, 2, 3}


def test_no_tree_width_without_a_server_that_drafts_trees_and_lists_the_knob():
    assert SearchSpace.from_model_info(TREE_INFO).max_tree_width == 3
    assert SearchSpace.from_model_info(model_info(tunable=TUNABLE)).max_tree_width == 1  # chains only
    assert SearchSpace.from_model_info(model_info(max_tree_width=3)).max_tree_width == 1  # not tunable
    space = SearchSpace.from_model_info(model_info())
    assert all("tree_width" not in params and policy.tree_width == 1 for params, policy in sample(space, 40))
    assert not space.contains(DraftPolicy(Drafter.MODEL, 4, 0.0, tree_width=2))
    assert LengthOnly(Drafter.MODEL).restrict(SearchSpace.from_model_info(TREE_INFO)).max_tree_width == 1


def test_the_grid_and_the_corners_hold_the_trees_of_the_model_drafter():
    space = SearchSpace.from_model_info(TREE_INFO, temperature_step=temperature_step(SamplerKind.GRID),
                                        adaptive=True)
    grid = list(initial_policies(SamplerKind.GRID, space, InitialDesign.CORNERS))
    # plain, n-gram x k, model x k x {0,.5,1,1.5} x widths 1..min(3, k) (a wider tree runs as one k wide)
    static = 1 + 8 + 4 * (1 + 2 + 6 * 3)
    chains = 1 + 8 + 8 * 4
    assert len({policy_key(p) for p in grid}) == len(grid) == static + (chains - 1) * 3  # the rule: chains only
    assert {p.tree_width for p in grid if p.drafter is Drafter.NGRAM} == {1}
    assert all(p.controller is Controller.STATIC for p in grid if p.tree_width > 1)
    corners = SearchSpace.from_model_info(TREE_INFO).corners()
    assert DraftPolicy(Drafter.MODEL, 8, 0.0, tree_width=3) in corners


def test_labels_claims_and_span_checks_tell_a_tree_from_its_chain():
    chain, tree = DraftPolicy(Drafter.MODEL, 6, 0.0, "s/1"), DraftPolicy(Drafter.MODEL, 6, 0.0, "s/1", tree_width=2)
    assert policy_key(tree).label() == "model k=6 T=0.00 tw=2" and policy_key(chain).label() == "model k=6 T=0.00"
    assert claim_key(policy_key(chain)) == "model|6|0.0"  # as stored before trees existed
    assert claim_key(policy_key(tree)) == "model|6|0.0|tw2"
    span = request_span("s/1")
    span["attributes"].update({"moespec.spec.drafter": "model", "moespec.spec.draft_length": 6,
                               "moespec.spec.draft_temperature": 0.0})
    as_chain = request_sample(span)
    span["attributes"]["moespec.spec.tree_width"] = 2
    as_tree = request_sample(span)
    assert (as_chain.tree_width, as_tree.tree_width) == (1, 2)
    assert ran_policy(as_tree, tree) and not ran_policy(as_chain, tree)
    assert ran_policy(as_chain, chain) and not ran_policy(as_tree, chain)


def landscape(policy: DraftPolicy) -> float:
    """Seconds per token: drafting pays, and a width-2 tree of 2 nodes pays most."""
    return {(0, 1): 1.0, (1, 1): 0.8, (2, 1): 0.7, (2, 2): 0.5}[policy.draft_length, policy.tree_width]


def test_a_grid_search_over_a_server_that_drafts_trees_runs_the_best_tree(tmp_path):
    server = FakeServer(model_info(max_draft_length=2, drafters=(Drafter.MODEL,),
                                   tunable=("draft_length", "tree_width"), max_tree_width=2))
    settings = TuneSettings(study_name="s", trials=5, tuner_id="t1", seed=0, sampler=SamplerKind.GRID,
                            window=WindowSpec(min_tokens=64, min_steps=8, max_seconds=0.5), remeasure_top=2,
                            poll_seconds=0.01, policy_check_seconds=0.02)
    collector = SpanCollector(request_sample)
    built = assemble(settings, st.open_storage(f"sqlite:///{tmp_path / 't.db'}"),
                     PolicyAdmin(server, "fake:0", retry_seconds=0.2, sleep=lambda s: None), collector)
    with SyntheticTraffic(server, collector.on_spans, landscape, noise=0.02):
        best = built.tuner.run()
    measured = {policy_key(built.space.policy_from_params(t.params, "")) for t in built.study.get_trials()
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    assert {(k.draft_length, k.tree_width) for k in measured} == {(0, 1), (1, 1), (2, 1), (2, 2)}
    assert (best.policy.draft_length, best.policy.tree_width) == (2, 2)
    assert server.policy == best.policy and any(p.tree_width == 2 for p in server.history)
    rows = {(r.draft_length, r.tree_width): r for r in trial_rows(built.study, built.space)}
    assert rows[2, 2].label.endswith("tw=2") and series_of(rows[2, 2]) == "model tree width 2"
    assert series_of(rows[2, 1]) != series_of(rows[2, 2])
