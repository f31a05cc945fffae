"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the suffix.

No model call: the longest n-gram suffix (n from max_n down to min_n) of the token history that
occurred before is looked up, and up to k tokens that followed its most recent occurrence are
proposed. The proposal is a point mass, so the standard acceptance rule keeps decoding lossless.
"""

from __future__ import annotations

import torch


def propose(history: torch.Tensor, k: int, min_n: int = 2, max_n: int = 4) -> torch.Tensor:
    """history [N] token ids -> up to k proposed ids (empty when nothing matches)."""
    N = history.shape[0]
    if k <= 0:
        return history[:0]
    for n in range(min(max_n, N - 1), min_n - 1, -1):
        suffix = history[N - n:]  # [n]
        # Every earlier n-gram start; the last window (the suffix itself) is excluded.
        windows = history[:N - 1].unfold(0, n, 1)  # [N-n, n]
        hits = (windows == suffix).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # the most recent occurrence wins
            return history[start:start + k]
    return history[:0]
