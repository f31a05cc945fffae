"""`sgl_kernel.speculative` stand-in: the NGRAM verify metadata (see the package docstring)."""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """From each request's n x n draft mask (row i marks i's ancestors and itself), in place:
    positions = seq_len + number of strict ancestors; retrieve_index = b*n + i; next_token = the
    first (lowest-index) child; next_sibling = the next node with the same parent (-1 for the root).
    A node's parent is its deepest strict ancestor, i.e. the one with the highest index."""
    n = draft_token_num
    if batch_size == 0:
        return
    masks = tree_mask.reshape(batch_size, n, n).bool()
    below = torch.ones(n, n, dtype=torch.bool).tril(-1)  # [i, j]: j < i
    views = [t.view(batch_size, n) for t in (positions, retrieve_index, retrieve_next_token, retrieve_next_sibling)]
    pos, index, next_token, next_sibling = views
    for b in range(batch_size):
        ancestors = masks[b] & below  # [n, n] strict ancestors
        parent = [max((j for j in range(i) if ancestors[i, j]), default=-1) for i in range(n)]
        pos[b] = ancestors.sum(dim=1) + int(verified_seq_len[b])
        index[b] = torch.arange(n) + b * n
        for i in range(n):
            children = [k for k in range(i + 1, n) if ancestors[k, i]]
            next_token[b, i] = children[0] if children else -1
            siblings = [k for k in range(i + 1, n) if parent[i] >= 0 and parent[k] == parent[i]]
            next_sibling[b, i] = siblings[0] if siblings else -1
