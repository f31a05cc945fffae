"""The prompt-lookup matcher: longest match wins, most recent occurrence, no match, window edges;
and the incremental index a sequence keeps against a from-scratch scan of its whole history."""

from __future__ import annotations

import random

import pytest

from service.engine.spec.ngram import NgramIndex, propose


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    # suffix (7, 8, 9): the 3-gram occurred at the start; a later 2-gram (8, 9) is followed by 5.
    history = [7, 8, 9, 1, 2, 0, 8, 9, 5, 3, 7, 8, 9]
    assert propose(history, 2, min_n=2, max_n=3) == [1, 2]


def test_most_recent_occurrence_wins():
    assert propose([4, 5, 1, 4, 5, 2, 4, 5], 1, min_n=2, max_n=2) == [2]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], 4) == []
    assert propose([1], 4) == []


def test_proposal_stops_at_the_end_of_the_history():
    assert propose([1, 2, 3, 1, 2], 5, min_n=2, max_n=2) == [3, 1, 2]


def test_match_at_the_very_start_and_k_zero():
    assert propose([9, 9, 9], 3, min_n=2, max_n=2) == [9]
    assert propose([9, 9, 9], 0) == []


def test_min_n_is_respected():
    history = [1, 6, 2, 3, 6]
    assert propose(history, 2, min_n=2, max_n=4) == []
    assert propose(history, 2, min_n=1, max_n=4) == [2, 3]


def scan(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: for n from max_n down, the latest earlier start of the suffix."""
    N = len(history)
    for n in range(min(max_n, N - 1), min_n - 1, -1):
        suffix = history[N - n:]
        starts = [s for s in range(0, N - n) if history[s:s + n] == suffix]
        if starts:
            return history[starts[-1] + n:starts[-1] + n + k]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (2, 4), (1, 3), (3, 5)])
def test_the_index_kept_as_the_history_grows_proposes_what_a_full_scan_does(min_n, max_n):
    """Histories over a small vocabulary (many repeats), grown by 1-4 tokens at a time as a step
    commits them, looked up after every growth with every k: identical to the scan each time."""
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(30):
        vocab = rng.randint(2, 6)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        index = NgramIndex(min_n, max_n)
        while len(history) < 80:
            for k in (1, 3, 8):
                assert index.propose(history, k) == scan(history, k, min_n, max_n), (history, k)
            history += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
