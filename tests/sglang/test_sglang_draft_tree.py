"""A verify window's tree and acceptance (service/sglang_backend/draft_tree.py), read from the plugin's
tree links (tap_windows) and from the recorder (attribution.attribute), against trees and outputs
written out by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from service.engine.model.weights import MODELS_DIR
from service.sglang_backend.attribution import RequestTokens, attribute
from service.sglang_backend.draft_tree import accepted_path, chain_parents, depths, parents_from_links
from service.sglang_backend.model_config import moe_geometry
from service.sglang_backend.records import ForwardMode, ForwardPass
from service.sglang_backend.stats_channel import RequestPass
from service.sglang_backend.steps import steps_from_windows
from service.sglang_backend.tap_windows import windows_from_tap
from service.sglang_plugin import wire
from service.types import Drafter, DraftPolicy, SpecStats

# A window of 7 nodes at start s = 4 (BFS order):      0 (t)
#                                                    /      \
#                                                 1 (a)     2 (b)
#                                                /    \        \
#                                             3 (c)  4 (d)    5 (c)
#                                               |
#                                             6 (e)
PARENTS = (-1, 0, 0, 1, 1, 2, 3)
NEXT_TOKEN = (1, 3, 5, 6, -1, -1, -1)
NEXT_SIBLING = (-1, 2, -1, 4, -1, -1, -1)
T, A, B, C, D, E, X = 10, 11, 12, 13, 14, 15, 99
IDS = (T, A, B, C, D, C, E)
POSITIONS = (4, 5, 5, 6, 6, 6, 7)


def test_links_give_the_parents_and_a_chain_is_the_degenerate_tree():
    assert parents_from_links(NEXT_TOKEN, NEXT_SIBLING) == PARENTS
    assert depths(PARENTS) == tuple(p - 4 for p in POSITIONS)
    assert parents_from_links((1, 2, 3, -1), (-1, -1, -1, -1)) == chain_parents(4) == (-1, 0, 1, 2)


@pytest.mark.parametrize(("next_token", "next_sibling"), [
    ((1, 3, -1, -1), (-1, -1, -1, -1)),  # node 2 hangs off nothing
    ((1, 0, -1, -1), (-1, -1, -1, -1)),  # a link back to the root
    ((1, -1, -1, -1), (-1, 7, -1, -1)),  # a sibling outside the window
], ids=["orphan", "cycle", "out-of-range"])
def test_links_that_are_not_a_tree_are_refused(next_token, next_sibling):
    with pytest.raises(ValueError, match="node"):
        parents_from_links(next_token, next_sibling)


@pytest.mark.parametrize(("committed", "path"), [
    ((A, C, E, X), (1, 3, 6)),  # down the left branch to the deepest node
    ((A, D, X), (1, 4)),  # the second child of a: the chain prefix [0, 1, 2] would stop at a
    ((B, C, X), (2, 5)),  # the right branch: a cousin of node 3 carries the same token
    ((X,), ()),  # nothing accepted
    ((A, C), (1, 3)),  # the output ends inside the tree
], ids=["left", "second-child", "cousin", "none", "cut"])
def test_the_accepted_path_follows_the_committed_tokens_through_the_tree(committed, path):
    seq = (0, 1, 2, 3, T) + committed
    assert accepted_path(IDS, PARENTS, 4, seq) == path


def window_pass(index: int, ids: tuple[int, ...], positions: tuple[int, ...]) -> ForwardPass:
    n = len(ids)
    return ForwardPass(index=index, mode=ForwardMode.TARGET_VERIFY, input_ids=ids, positions=positions,
                       extend_seq_lens=None, topk_ids=torch.zeros(1, n, 8, dtype=torch.int32),
                       physical_ids=torch.zeros(1, n, 8, dtype=torch.int32), physical_to_logical=None)


def test_the_recorder_settles_tree_windows_by_where_the_next_one_starts():
    # Pass 1 accepts a, d through node 4 (not on the chain prefix: leading matches say 1); the next
    # window must still be found at s + 3, and the first one settled at 2 accepted drafts.
    prompt = (0, 1, 2, 3)
    seq_tail = (T, A, D, B, E, X)
    request = RequestTokens(prompt, seq_tail)
    first = window_pass(0, IDS, POSITIONS)
    second = window_pass(1, (B, E, X, C, C, C, C), (7, 8, 9, 8, 8, 9, 10))
    windows, = attribute([first, second], [request], speculative=True, verify_width=7, moe_layers=(0,))
    assert [(w.start, w.accepted, w.committed) for w in windows] == [(4, 2, 3), (7, 2, 2)]


def test_a_window_past_where_the_previous_one_could_reach_is_not_the_requests():
    # A window whose start lies past what the previous window could have reached is someone else's.
    request = RequestTokens((0, 1, 2, 3), (T, A, D, B, E, X))
    first = window_pass(0, IDS, POSITIONS)
    too_far = window_pass(1, (E, X, 0, 0, 0, 0, 0), (8, 9, 9, 9, 9, 9, 9))
    windows, = attribute([first, too_far], [request], speculative=True, verify_width=7, moe_layers=(0,))
    assert [w.start for w in windows] == [4]


# Per node and layer, the distinct experts over its path (what the plugin measures): node n's are 10 * n + layer.
PATH_UNIONS = np.array([[[10 * n + layer for layer in range(4)] for n in range(len(IDS))]], np.int16)


def tap_pass(next_token, next_sibling) -> RequestPass:
    w, layers = len(IDS), moe_geometry(MODELS_DIR / "target").num_hidden_layers
    tree = next_token is not None
    return RequestPass(wire.PassStats(
        pass_id=3, mode=int(ForwardMode.TARGET_VERIFY), rids=("r",), width=w, start_ns=0, end_ns=1,
        input_ids=np.array(IDS, np.int32), positions=np.array(POSITIONS, np.int32),
        unions=np.full((1, layers), 9, np.int16), batch_union=np.full(layers, 9, np.int16),
        pair_mean=np.zeros((1, layers), np.float32), pair_min=np.zeros((1, layers), np.int16),
        next_token=None if next_token is None else np.array(next_token, np.int16),
        next_sibling=None if next_sibling is None else np.array(next_sibling, np.int16),
        path_unions=PATH_UNIONS[:, :, :layers] if tree else None), index=0, pass_number=0)


def test_the_plugins_tree_links_decide_the_acceptance_of_a_window():
    # SGLang accepted a, d through node 4; read as a chain, the window would stop after a.
    geometry = moe_geometry(MODELS_DIR / "target")
    request = RequestTokens((0, 1, 2, 3), (T, A, D, B, E, X))
    on_tree, = windows_from_tap([tap_pass(NEXT_TOKEN, NEXT_SIBLING)], request, geometry)
    as_chain, = windows_from_tap([tap_pass(None, None)], request, geometry)
    assert (on_tree.accepted, on_tree.committed) == (2, 3)
    assert (as_chain.accepted, as_chain.committed) == (1, 2)


def test_a_tree_policys_window_becomes_a_tree_step_with_each_branchs_union():
    """The StepRecord of a tree window, as the embedded engine records trees: parents over the drafted
    nodes (-1 = the window's first token), on-path flags, and per root-to-leaf branch its leaf's path
    union; a chain policy's step over the same window (and a tree that came out a chain) records none."""
    geometry = moe_geometry(MODELS_DIR / "target")
    request = RequestTokens((0, 1, 2, 3), (T, A, D, B, E, X))
    window, = windows_from_tap([tap_pass(NEXT_TOKEN, NEXT_SIBLING)], request, geometry, ngram=False)
    tree_policy = DraftPolicy(Drafter.MODEL, 6, 0.0, tree_width=2)
    step, = steps_from_windows([window], tree_policy, geometry, decode_seconds=1.0, decode_step_seconds=0.5)
    assert step.tree_parents == (-1, -1, 0, 0, 1, 2) and step.drafted == 6 and step.accepted == 2
    assert step.accepted_per_position == (True, False, False, True, False, False)  # nodes 1 (a) and 4 (d)
    assert step.tree_depth == 3 and step.branches == 3
    # Leaves 4, 5, 6 (window nodes): branches [a, d], [b, c], [a, c, e].
    assert step.branch_unique == tuple(tuple(int(u) for u in PATH_UNIONS[0, leaf]) for leaf in (4, 5, 6))
    assert step.unique_experts == (9, 9, 9, 9)  # the whole tree's
    assert SpecStats.from_steps([step], tree_policy, 4).accepted_per_position[:2] == (1, 1)  # by depth
    chain_step, = steps_from_windows([window], DraftPolicy(Drafter.MODEL, 6, 0.0), geometry, decode_seconds=1.0,
                                     decode_step_seconds=0.5)
    assert chain_step.tree_parents == () and chain_step.branch_unique == ()
    chain = replace(window, parents=chain_parents(7))
    assert steps_from_windows([chain], tree_policy, geometry, decode_seconds=1.0,
                              decode_step_seconds=0.5)[0].tree_parents == ()


def test_only_ngram_windows_are_searched_for_filler():
    """Six children of the root at one position carrying token 0 (NGRAM's filler): filler in an NGRAM
    window, real drafts in a model drafter's tree."""
    geometry = moe_geometry(MODELS_DIR / "target")
    request = RequestTokens((0, 1, 2, 3), (T, X))
    record = tap_pass((1, -1, -1, -1, -1, -1, -1), (-1, 2, 3, 4, 5, 6, -1))
    record.stats.input_ids[1:] = 0
    record.stats.positions[1:] = 5
    assert [w.padding for w in windows_from_tap([record], request, geometry)] == [6]
    assert [w.padding for w in windows_from_tap([record], request, geometry, ngram=False)] == [0]
