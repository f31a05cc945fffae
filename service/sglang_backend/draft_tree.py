"""The shape of one verify window, and which of its drafts the target accepted.

SGLang verifies k + 1 tokens per request: the last committed token (node 0, the root) and k drafts.
EAGLE with topk 1 drafts a chain; NGRAM drafts a tree (several continuations of one node, in BFS
order: every node comes after its parent) and pads short matches with filler nodes hung off the
root. SGLang describes the tree by two links per node, `retrieve_next_token` (first child) and
`retrieve_next_sibling` (next child of the same parent), -1 = none; the plugin forwards both.

Acceptance follows from the request's final tokens: the accepted drafts are the path from the root
whose node at depth d carries the token committed at position start + d (greedy keeps the argmax,
rejection sampling resamples without the rejected token, so a rejected draft never carries the token
the target put there; siblings carry distinct tokens, so the path is unique).
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_parents(width: int) -> tuple[int, ...]:
    """A chain: node j hangs off node j - 1."""
    return tuple(range(-1, width - 1))


def parents_from_links(next_token: Sequence[int], next_sibling: Sequence[int]) -> tuple[int, ...]:
    """Each node's parent (-1 for the root) from SGLang's first-child / next-sibling links.
    Raises ValueError on links that do not form a tree rooted at node 0."""
    width = len(next_token)
    parents = [-2] * width  # -2: not reached yet
    parents[0] = -1
    for node in range(width):  # BFS order: a node's parent is reached before the node
        if parents[node] == -2:
            raise ValueError(f"node {node} of a {width}-node window is nobody's child")
        child = int(next_token[node])
        while child >= 0:
            if child <= node or child >= width or parents[child] != -2:
                raise ValueError(f"node {node}: child link to {child} in a {width}-node window")
            parents[child] = node
            child = int(next_sibling[child])
    return tuple(parents)


def accepted_path(input_ids: Sequence[int], parents: Sequence[int], start: int, seq: Sequence[int]) -> tuple[int, ...]:
    """Nodes of the accepted drafts, root excluded, in depth order."""
    path, node = [], 0
    while True:
        pos = start + len(path) + 1
        if pos >= len(seq):
            return tuple(path)
        nxt = next((c for c in range(node + 1, len(input_ids)) if parents[c] == node and input_ids[c] == seq[pos]),
                   None)
        if nxt is None:
            return tuple(path)
        path.append(nxt)
        node = nxt


def depths(parents: Sequence[int]) -> tuple[int, ...]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return tuple(out)
