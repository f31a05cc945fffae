"""`moespec bench adaptive`'s round orders: every contender runs once a round, and no contender
always runs right after the same one (what a run leaves behind must not weigh on one contender)."""

from __future__ import annotations

import collections

import pytest

from service.bench.adaptive import round_order


def neighbours(rounds: list[list[int]]) -> collections.Counter:
    return collections.Counter((order[i], order[i + 1]) for order in rounds for i in range(len(order) - 1))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_each_round_runs_every_contender_once(n):
    assert all(sorted(round_order(n, r)) == list(range(n)) for r in range(3 * n))


@pytest.mark.parametrize("n", [2, 4, 6])
def test_for_an_even_count_one_square_of_rounds_has_every_ordered_pair_of_neighbours_once(n):
    pairs = neighbours([round_order(n, r) for r in range(n)])
    assert len(pairs) == n * (n - 1) and set(pairs.values()) == {1}


@pytest.mark.parametrize("n", [3, 5, 7])
def test_for_an_odd_count_two_squares_have_every_ordered_pair_of_neighbours_twice(n):
    pairs = neighbours([round_order(n, r) for r in range(2 * n)])
    assert len(pairs) == n * (n - 1) and set(pairs.values()) == {2}


def test_in_five_rounds_of_five_no_contender_always_follows_the_same_one():
    """The benchmark's default: five contenders, five rounds. Rotated instead, the rule always ran
    right after Cascade."""
    rounds = [round_order(5, r) for r in range(5)]
    for contender in range(5):
        before = {order[order.index(contender) - 1] for order in rounds if order.index(contender) > 0}
        assert len(before) >= 2, contender


def test_a_rotation_is_the_negative_control():
    rotated = [[(i + r) % 5 for i in range(5)] for r in range(5)]
    before_last = {order[order.index(4) - 1] for order in rotated if order.index(4) > 0}
    assert before_last == {3}
