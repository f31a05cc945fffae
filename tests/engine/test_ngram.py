"""The prompt-lookup matcher: longest match wins, most recent occurrence, no match, window edges."""

from __future__ import annotations

import torch

from service.engine.ngram import propose


def t(*ids):
    return torch.tensor(ids)


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    # suffix (7, 8, 9): the 3-gram occurred at the start; a later 2-gram (8, 9) is followed by 5.
    history = t(7, 8, 9, 1, 2, 0, 8, 9, 5, 3, 7, 8, 9)
    assert propose(history, 2, min_n=2, max_n=3).tolist() == [1, 2]


def test_most_recent_occurrence_wins():
    history = t(4, 5, 1, 4, 5, 2, 4, 5)
    assert propose(history, 1, min_n=2, max_n=2).tolist() == [2]


def test_no_match_proposes_nothing():
    assert propose(t(1, 2, 3, 4, 5), 4).numel() == 0
    assert propose(t(1), 4).numel() == 0


def test_proposal_stops_at_the_end_of_the_history():
    history = t(1, 2, 3, 1, 2)
    assert propose(history, 5, min_n=2, max_n=2).tolist() == [3, 1, 2]


def test_match_at_the_very_start_and_k_zero():
    history = t(9, 9, 9)
    assert propose(history, 3, min_n=2, max_n=2).tolist() == [9]
    assert propose(history, 0).numel() == 0


def test_min_n_is_respected():
    history = t(1, 6, 2, 3, 6)
    assert propose(history, 2, min_n=2, max_n=4).numel() == 0
    assert propose(history, 2, min_n=1, max_n=4).tolist() == [2, 3]
