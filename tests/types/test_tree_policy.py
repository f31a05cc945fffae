"""Draft trees as a policy: DraftPolicy.tree_width is validated with the field named, a tree step's
record carries its shape and per-branch unions, and the request's stats read a tree by depth."""

from __future__ import annotations

import dataclasses

import pytest

from service.types import (
    MAX_TREE_WIDTH,
    Controller,
    Drafter,
    DraftPolicy,
    InvalidRequest,
    PolicyCell,
    SpecStats,
    StepRecord,
    tree_branches,
    tree_depths,
)

TREE = DraftPolicy(Drafter.MODEL, 6, 0.0, "tree", tree_width=2)
CHAIN = DraftPolicy(Drafter.MODEL, 3, 0.0, "chain")

# A 6-node tree of width 2: the first token r has children 0 and 1; 0 has 2 and 3; 2 has 4; 1 has 5.
#          r
#        /   \
#       0     1
#      / \     \
#     2   3     5
#     |
#     4
PARENTS = (-1, -1, 0, 0, 2, 1)


def tree_step(accepted_path: tuple[int, ...], branch_unique=((10, 7), (9, 6), (8, 9)), unique=(14, 12),
              policy: DraftPolicy = TREE) -> StepRecord:
    on_path = tuple(i in accepted_path for i in range(len(PARENTS)))
    return StepRecord.of_policy(policy, drafted=len(PARENTS), accepted=len(accepted_path),
                                committed=len(accepted_path) + 1, accepted_per_position=on_path,
                                window=len(PARENTS) + 1, unique_experts=unique, shared_experts=1, num_experts=64,
                                top_k=8, draft_seconds=0.001, verify_seconds=0.004, decode_step_equivalents=2.0,
                                tree_parents=PARENTS, branch_unique=branch_unique)


def chain_step(accepted: int, unique=(11, 9)) -> StepRecord:
    return StepRecord.of_policy(CHAIN, drafted=3, accepted=accepted, committed=accepted + 1,
                                accepted_per_position=tuple(i < accepted for i in range(3)), window=4,
                                unique_experts=unique, shared_experts=1, num_experts=64, top_k=8,
                                draft_seconds=0.001, verify_seconds=0.003, decode_step_equivalents=1.5)


# -- validation -------------------------------------------------------------------------------------


def test_a_chain_is_width_one_by_default_and_trees_go_up_to_the_maximum():
    assert DraftPolicy().tree_width == 1
    for width in range(1, MAX_TREE_WIDTH + 1):
        dataclasses.replace(TREE, tree_width=width).validate()


@pytest.mark.parametrize("width", [0, -1, MAX_TREE_WIDTH + 1])
def test_a_width_out_of_range_is_refused_naming_the_field(width):
    with pytest.raises(InvalidRequest) as e:
        dataclasses.replace(TREE, tree_width=width).validate()
    assert e.value.field == "policy.tree_width" and f"[1, {MAX_TREE_WIDTH}]" in str(e.value)


def test_a_tree_needs_the_model_drafter():
    with pytest.raises(InvalidRequest) as e:
        DraftPolicy(Drafter.NGRAM, 4, tree_width=2).validate()
    assert e.value.field == "policy.tree_width" and "ngram drafter proposes chains only" in str(e.value)


@pytest.mark.parametrize("controller", [c for c in Controller if c is not Controller.STATIC])
def test_a_tree_needs_the_static_controller(controller):
    with pytest.raises(InvalidRequest) as e:
        dataclasses.replace(TREE, controller=controller).validate()
    assert e.value.field == "policy.tree_width" and "plans chain lengths" in str(e.value)


def test_a_cells_tree_is_validated_under_the_cells_name():
    table = DraftPolicy(cells=(PolicyCell(DraftPolicy(Drafter.NGRAM, 4, tree_width=3)),))
    with pytest.raises(InvalidRequest) as e:
        table.validate()
    assert e.value.field == "policy.cells[0].policy.tree_width"
    DraftPolicy(cells=(PolicyCell(TREE),)).validate()  # a tree cell of the model drafter is fine


# -- the tree's shape -------------------------------------------------------------------------------


def test_depths_and_branches_follow_the_parents():
    assert tree_depths(PARENTS) == (1, 1, 2, 2, 3, 2)
    assert tree_branches(PARENTS) == ((0, 3), (0, 2, 4), (1, 5))  # leaves 3, 4, 5 in node order
    assert tree_branches((-1, 0, 1)) == ((0, 1, 2),)  # a chain is one branch
    assert tree_branches(()) == ()


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 2, 0), (-2,)])
def test_a_parent_that_is_not_an_earlier_node_is_refused(parents):
    with pytest.raises(ValueError):
        tree_branches(parents)


def test_a_tree_step_carries_its_policy_width_shape_and_branch_unions():
    step = tree_step(accepted_path=(0, 2, 4))
    assert step.tree_width == 2 and step.is_tree
    assert step.tree_depth == 3 and step.branches == 3
    assert step.branch_unique_mean == pytest.approx((9.0, 22 / 3))
    assert step.branch_unique_max == (10, 9)
    # node 2 is the second node of the path, but acceptance by depth is the path's prefix
    assert step.accepted_per_position == (True, False, True, False, True, False)
    assert step.accepted_per_depth == (True, True, True)


def test_a_chain_step_is_its_own_one_branch():
    step = chain_step(accepted=2)
    assert step.tree_width == 1 and not step.is_tree
    assert (step.tree_parents, step.branch_unique) == ((), ())
    assert step.tree_depth == 3 and step.branches == 1
    assert step.branch_unique_mean == (11.0, 9.0) and step.branch_unique_max == (11, 9)
    assert step.accepted_per_depth == step.accepted_per_position == (True, True, False)


def test_a_tree_policy_step_that_drafted_nothing_is_no_tree():
    step = dataclasses.replace(tree_step(()), drafted=0, accepted_per_position=(), window=1, tree_parents=(),
                               branch_unique=())
    assert step.tree_width == 2 and not step.is_tree and step.tree_depth == 0


# -- the request's stats ----------------------------------------------------------------------------


def test_stats_count_a_trees_acceptance_by_depth_and_average_the_branch_unions():
    steps = [tree_step(accepted_path=(1, 5)), tree_step(accepted_path=(0, 2, 4)), tree_step(accepted_path=())]
    stats = SpecStats.from_steps(steps, TREE, num_layers=2)
    assert stats.accepted_per_position == (2, 2, 1, 0, 0, 0)  # by depth; sums to the accepted tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens == 5
    assert stats.tree_width == 2
    assert stats.unique_experts_mean == (14.0, 12.0)  # the whole tree's union, as for a chain's window
    assert stats.branch_unique_experts_mean == pytest.approx((9.0, 22 / 3))


def test_a_table_with_a_tree_cell_averages_chain_steps_as_one_branch():
    table = DraftPolicy(policy_id="table", cells=(PolicyCell(TREE, max_batch=1),))
    stats = SpecStats.from_steps([tree_step((0,)), chain_step(1)], table, num_layers=2)
    assert stats.tree_width == 1  # the policy's own width, as draft_length is the policy's own length
    assert stats.branch_unique_experts_mean == pytest.approx(((9.0 + 11.0) / 2, (22 / 3 + 9.0) / 2))


def test_chain_stats_are_unchanged():
    stats = SpecStats.from_steps([chain_step(2), chain_step(0)], CHAIN, num_layers=2)
    assert stats.accepted_per_position == (1, 1, 0)
    assert (stats.tree_width, stats.branch_unique_experts_mean) == (1, ())
