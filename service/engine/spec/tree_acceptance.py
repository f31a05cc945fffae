"""The verdict on one draft tree: the root-to-node path the target accepts, and its next token.

A tree's nodes come in drafting order; node i carries a token and its parent (ROOT: the window's first
token, the last committed one). The verify pass gives the target's distribution at the root and at
every node, each given that node's own path (tree attention), as rows [n + 1, V]: row 0 the root's,
row i + 1 node i's. A chain is the tree whose nodes each have one child.

Greedy (the target a point mass at its argmax): from the root, move to the child whose token is the
target's argmax at the current node while there is one; the bonus token is the argmax at the last node
reached. The committed tokens are exactly plain greedy decoding's, for any tree.

Sampled: at the current node, with target distribution p there, its children are offered in drafting
order against a residual r (first p): a child x is accepted with probability min(1, r(x) / q_x(x)), q_x
being the distribution the child was drawn from; after a rejection the residual becomes
norm(max(0, r - q_x)). Siblings drawn from their parent's draft distribution q without replacement
(`Children.SAMPLED`: each from q with its earlier siblings' tokens taken out and the rest renormalised)
take that renormalised q as q_x; a child taken deterministically (one of the draft's top candidates,
each token at most once among its siblings, `Children.TOP`) takes a point mass on its own token, so a
rejection removes that token from r. If every child is rejected, the bonus token is drawn from the
residual. (The point-mass rule is right for children drawn any way, duplicates included: for every
fixed list of candidates it outputs p; the rule with q accepts sampled children more often.)
This is recursive rejection sampling (SpecInfer's multi-step speculative sampling; without replacement,
as in recursive speculative decoding, Jeon et al. 2024): whichever child is accepted, and the bonus after
the last rejection, is distributed as p, so the committed tokens follow the target's distribution exactly
(tests/engine/spec/test_tree_acceptance.py checks the joint law of the first two tokens, with three wrong
rules as negative controls). Why without replacement: a rejected token has no mass left in the residual
(it was rejected because q_x(x) > r(x)), so a sibling drawn again from the whole q repeats it, a certain
rejection, as often as q(x): with a sure draft, most of the time.

Shape legend: n nodes, V vocabulary.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from service.engine.spec.sampling import sample
from service.types import tree_depths

ROOT = -1


class Children(enum.Enum):
    SAMPLED = "sampled"  # drawn from the parent's draft distribution without replacement (siblings distinct)
    TOP = "top"  # the draft's top candidates at the parent, distinct tokens


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [n] each node's token
    parents: tuple[int, ...]  # [n] each node's parent: an earlier node, or ROOT

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} parents")
        tree_depths(self.parents)  # refuses a parent that is not ROOT or an earlier node

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Each node the only child of the one before (the shape a chain of drafts has)."""
        return self.parents == tuple(range(ROOT, self.size - 1))

    def children(self, node: int) -> list[int]:
        """The children of `node` (ROOT for the root's), in drafting order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for ROOT)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def accept_tree_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """argmax [n + 1]: the target's argmax at the root and at each node -> (the accepted path's nodes,
    the bonus token)."""
    node, path = ROOT, []
    while True:
        wanted = argmax[node + 1]
        match = next((c for c in tree.children(node) if tree.tokens[c] == wanted), None)
        if match is None:
            return path, wanted
        node = match
        path.append(node)


def accept_tree_sampled(tree: DraftTree, p: torch.Tensor, q: torch.Tensor | None, children: Children,
                        generator: torch.Generator) -> tuple[list[int], int]:
    """p [n + 1, V] the target's distributions at the root and at each node; q [n + 1, V] the draft's
    at the same places (what each one's children were drawn from; None for `Children.TOP`, whose
    children take point masses) -> (the accepted path's nodes, the bonus token)."""
    if children is Children.SAMPLED and q is None:
        raise ValueError("children drawn from the draft's distributions need those distributions (q)")
    node, path = ROOT, []
    while True:
        residual = p[node + 1].double()
        left = None if children is Children.TOP else q[node + 1].double()  # what the next sibling is drawn from
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            if left is None:
                offered = torch.zeros_like(residual)
                offered[x] = 1.0
            else:
                offered = left / left.sum()
                left = left.clone()
                left[x] = 0.0
            if float(torch.rand((), generator=generator)) * float(offered[x]) < float(residual[x]):
                accepted = child
                break
            residual = _rejected(residual, offered)
        if accepted is None:
            return path, int(sample(residual[None].float(), generator)[0])
        node = accepted
        path.append(node)


def _rejected(residual: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)): what remains of r after a child drawn from q was rejected. No mass left
    means rejection had probability 0 (r <= q everywhere with equal totals: r == q); r is kept."""
    rest = (residual - offered).clamp(min=0)
    total = float(rest.sum())
    return rest / total if total > 0 else residual
