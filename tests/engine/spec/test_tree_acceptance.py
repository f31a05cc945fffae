"""Draft-tree verdicts (service/engine/spec/tree_acceptance.py) against the target they must reproduce.

A toy target and draft over a 5-token vocabulary, each a fixed distribution per prefix: trees of
several shapes are drafted from the draft (children drawn without replacement, or its top candidates),
verified by the rule, and decoding goes on until two tokens are committed.
- Greedy: the committed tokens are plain greedy decoding's, for every shape.
- Sampled: the joint law of the first two tokens is the target's (chi-square over the 25 pairs), and
  three wrong rules kept as negative controls fail the same test (their power is asserted): one that
  never updates the residual after a rejection, one that accepts a child by the target alone,
  ignoring the distribution the child was drawn from, and one that offers distinct siblings as if each
  were drawn from the whole q (SpecInfer's rule for independent draws, the earlier siblings not taken out).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from service.engine.spec import tree_acceptance
from service.engine.spec.sampling import sample
from service.engine.spec.tree_acceptance import ROOT, Children, DraftTree, accept_tree_greedy, accept_tree_sampled
from service.types import tree_depths

V = 5
SHAPES = [(1, 3), (2, 2), (3, 1), (2, 3), (3, 2)]  # (width, depth): width 1 is a chain


def _table(seed: int, temperature: float):
    """prefix (tuple of tokens) -> a distribution over V, fixed per prefix."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            g = torch.Generator().manual_seed(seed * 1_000_003 + hash(prefix) % 1_000_003)
            cache[prefix] = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5 / temperature).softmax(-1)
        return cache[prefix]

    return dist


TARGET, DRAFT = _table(1, 1.0), _table(2, 0.7)  # overlapping but different


def draft_tree(prefix: tuple[int, ...], width: int, depth: int, children: Children,
               generator: torch.Generator) -> DraftTree:
    tokens, parents = [], []
    frontier = [(ROOT, prefix)]
    for _ in range(depth):
        nxt = []
        for parent, path in frontier:
            q = DRAFT(path)
            picks = (q.topk(width).indices.tolist() if children is Children.TOP
                     else torch.multinomial(q, width, replacement=False, generator=generator).tolist())
            for token in picks:
                tokens.append(token)
                parents.append(parent)
                nxt.append((len(tokens) - 1, path + (token,)))
        frontier = nxt
    return DraftTree(tuple(tokens), tuple(parents))


def rows(tree: DraftTree, prefix: tuple[int, ...], dist) -> torch.Tensor:
    """[n + 1, V]: dist at the root and at each node's own path."""
    paths = [prefix] + [prefix + tuple(tree.tokens[j] for j in tree.path(i)) for i in range(tree.size)]
    return torch.stack([dist(p) for p in paths])


def first_two(rule, width: int, depth: int, children: Children, generator: torch.Generator) -> tuple[int, int]:
    """Decode with trees until two tokens are committed -> those two."""
    out: tuple[int, ...] = ()
    while len(out) < 2:
        tree = draft_tree(out, width, depth, children, generator)
        path, bonus = rule(tree, rows(tree, out, TARGET), rows(tree, out, DRAFT), children, generator)
        out += tuple(tree.tokens[i] for i in path) + (bonus,)
    return out[0], out[1]


def pvalue(rule, width: int, depth: int, children: Children, runs: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(runs):
        a, b = first_two(rule, width, depth, children, g)
        counts[a, b] += 1
    want = torch.stack([TARGET(())[a] * TARGET((a,)) for a in range(V)]) * runs  # [V, V]
    return float(chisquare(counts.flatten().numpy(), want.flatten().numpy()).pvalue)


# -- the wrong rules kept as negative controls ------------------------------------------------------------

def no_residual_update(tree, p, q, children, generator):
    """Every child is offered against p itself: later siblings are accepted too often."""
    node, path = ROOT, []
    while True:
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            qx = 1.0 if children is Children.TOP else float(q[node + 1][x])
            if float(torch.rand((), generator=generator)) * qx < float(p[node + 1][x]):
                accepted = child
                break
        if accepted is None:
            return path, int(sample(p[node + 1][None].float(), generator)[0])
        node = accepted
        path.append(node)


def accept_by_target_alone(tree, p, q, children, generator):
    """A child is accepted with probability r(x), whatever distribution it was drawn from, and a
    rejection takes q's mass off the residual: the acceptance step of a rule for point masses with the
    residual of a rule for sampled children. (Point-mass acceptance with a point-mass residual, a
    rejected token's mass taken off, is right for any children: that is `Children.TOP`'s rule.)"""
    node, path = ROOT, []
    while True:
        residual, accepted = p[node + 1].double(), None
        for child in tree.children(node):
            x = tree.tokens[child]
            if float(torch.rand((), generator=generator)) < float(residual[x]):
                accepted = child
                break
            residual = tree_acceptance._rejected(residual, q[node + 1].double())
        if accepted is None:
            return path, int(sample(residual[None].float(), generator)[0])
        node = accepted
        path.append(node)


def independent_draws_rule(tree, p, q, children, generator):
    """Every sibling offered against the whole q, as if drawn independently of the ones before it: right
    for independent draws, wrong for distinct ones (a later sibling's real q_x gives its token more mass)."""
    node, path = ROOT, []
    while True:
        residual, accepted = p[node + 1].double(), None
        for child in tree.children(node):
            x = tree.tokens[child]
            offered = q[node + 1].double()
            if float(torch.rand((), generator=generator)) * float(offered[x]) < float(residual[x]):
                accepted = child
                break
            residual = tree_acceptance._rejected(residual, offered)
        if accepted is None:
            return path, int(sample(residual[None].float(), generator)[0])
        node = accepted
        path.append(node)


# -- tests ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("width, depth", SHAPES)
@pytest.mark.parametrize("children", list(Children))
def test_greedy_commits_plain_greedy_decodings_tokens_for_every_shape(width, depth, children):
    g = torch.Generator().manual_seed(width * 10 + depth)
    for _ in range(50):
        out: tuple[int, ...] = ()
        while len(out) < 6:
            tree = draft_tree(out, width, depth, children, g)
            argmax = rows(tree, out, TARGET).argmax(-1).tolist()
            path, bonus = accept_tree_greedy(tree, argmax)
            assert [tree.parents[n] for n in path] == [ROOT, *path][:len(path)]  # a root-to-node path
            out += tuple(tree.tokens[i] for i in path) + (bonus,)
        plain: tuple[int, ...] = ()
        while len(plain) < len(out):
            plain += (int(TARGET(plain).argmax()),)
        assert out == plain


def point_mass_rule(tree, p, q, children, generator):
    """`Children.TOP`'s rule on any children: right whatever drew them (each fixed candidate list gives p)."""
    return accept_tree_sampled(tree, p, None, Children.TOP, generator)


@pytest.mark.parametrize("rule, width, depth, children", [
    (accept_tree_sampled, 2, 2, Children.SAMPLED), (accept_tree_sampled, 3, 2, Children.SAMPLED),
    (accept_tree_sampled, 2, 2, Children.TOP), (accept_tree_sampled, 3, 1, Children.TOP),
    (point_mass_rule, 3, 2, Children.SAMPLED)])
def test_sampled_first_two_tokens_follow_the_target(rule, width, depth, children):
    assert pvalue(rule, width, depth, children, runs=6000, seed=width + depth) > 1e-3


@pytest.mark.parametrize("rule, children", [(no_residual_update, Children.SAMPLED), (no_residual_update, Children.TOP),
                                            (accept_by_target_alone, Children.SAMPLED),
                                            (independent_draws_rule, Children.SAMPLED)])
def test_the_negative_controls_fail_the_same_test(rule, children):
    """Power: with the same runs and shapes the right rule passes, each wrong rule is rejected."""
    assert pvalue(rule, 3, 2, children, runs=6000, seed=7) < 1e-6


def test_a_tree_is_checked_and_walked():
    tree = DraftTree((5, 6, 7, 8), (ROOT, ROOT, 0, 2))
    assert tree.children(ROOT) == [0, 1] and tree.children(0) == [2] and tree.path(3) == [0, 2, 3]
    assert tree_depths(tree.parents) == (1, 1, 2, 3) and not tree.is_chain
    assert DraftTree((4, 4, 2), (ROOT, 0, 1)).is_chain
    with pytest.raises(ValueError, match="parent"):
        DraftTree((1, 2), (ROOT, 1))
    with pytest.raises(ValueError, match="need those distributions"):
        accept_tree_sampled(tree, torch.ones(5, V) / V, None, Children.SAMPLED, torch.Generator())
    assert tree_acceptance.accept_tree_greedy(DraftTree((), ()), [3]) == ([], 3)

