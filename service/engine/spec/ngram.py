"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the suffix.

No model call: the longest n-gram suffix (n from max_n down to min_n) of the token history that
occurred before is looked up, and up to k tokens that followed its most recent occurrence are
proposed. The proposal is a point mass, so the standard acceptance rule keeps decoding lossless.

A sequence's history only grows, so `NgramIndex` keeps, per n, the most recent start of every
n-gram seen so far and indexes only the tokens committed since its last lookup: a lookup is a few
dictionary reads instead of a scan of the whole history per n (the scan cost tens of microseconds
a step, most of an n-gram step's drafting time, and grew with the context).
"""

from __future__ import annotations


class NgramIndex:
    """The n-gram lookup over one growing token history (a sequence's prompt + committed tokens)."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._last_start: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._next_start = dict.fromkeys(range(min_n, max_n + 1), 0)  # per n: the first start not indexed

    def propose(self, history: list[int], k: int) -> list[int]:
        """history: the tokens so far (this index's earlier histories as its prefix) -> up to k ids."""
        N = len(history)
        if k <= 0:
            return []
        # Index every n-gram that is followed by a token (start + n <= N - 1): the suffix itself is
        # not, so it never matches its own occurrence.
        for n, last in self._last_start.items():
            first, end = self._next_start[n], N - n  # the new starts: first <= s < end
            if end > first:
                grams = zip(*(history[first + j:end + j] for j in range(n)), strict=True)  # each start's n-gram
                last.update(zip(grams, range(first, end), strict=True))  # later starts overwrite: the latest wins
                self._next_start[n] = end
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            start = self._last_start[n].get(tuple(history[N - n:]))
            if start is not None:
                return history[start + n:start + n + k]
        return []


def propose(history: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """One lookup over `history` (a fresh index: for one-off calls; a sequence keeps its own)."""
    return NgramIndex(min_n, max_n).propose(history, k)
