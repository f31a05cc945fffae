"""Draft trees with the draft head (and, through eagle3_trees.py, with an EAGLE-3 draft).

A tree policy has a width w and a node budget N (its draft_length). Per sequence, the head first
catches up on the entries its cache lacks; its last entry, at the last committed token (the root),
gives the distribution of the next token. Then, by the policy's draft temperature:

Temperature 0, the head's top candidates (EAGLE-2's tree, grown best first), one C call per sequence
(`Kernels.head_tree`, csrc/head_tree.c):
- every expanded node (the root first) offers its w likeliest tokens as children, scored by their
  path's log-probability (the sum along the path of each token's log-probability under the head, at the
  temperature that estimates its acceptance: `ranking_temperature`, tree_calibration.py);
- the best child not yet expanded is expanded next (one head row per pass, at a head-cache row of its
  own past the root, attending the prefix and its path: kernels/attention.py), while it scores at least
  the N-th best child so far (a descendant never scores above its ancestor, so below that none could
  enter the tree), at most N times and while the head cache has rows left;
- the tree is the N best-scored children (ties to the earlier one): the exact top N by path score, a
  node's ancestors outscoring it; where the head is sure it is a chain, grown at a chain's cost.
The children are the head's top candidates, fixed given the context: the acceptance rule treats each
as a point mass (tree_acceptance.Children.TOP), which keeps sampled output exactly the target's.

Temperature T > 0, sampled branches: the root's w children are drawn from the head's distribution q at
T without replacement (each from q with the earlier ones' tokens taken out), and the first continues as
a chain of the remaining N - w nodes, one child drawn from q at each: the head's sampled chain
(`Kernels.head_draft`, one C call) and w - 1 more draws at the root. A sibling at the root is tried only
after the draws before it there are rejected, while each node deeper along the chain follows an
accepted one, so the budget goes deep first. The shape is fixed before anything is drawn, so the
acceptance rule knows what each child was drawn from (tree_acceptance.Children.SAMPLED): a sampled
request accepts one of w distinct draws at the root where a chain offers one. (A shape chosen from the
draws, as the top-candidate tree is, would bias them: that tree keeps point masses instead.)

Shape legend: w width, N node budget, Vd draft vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.model_drafting import head_pending
from service.engine.spec.sampling import sample
from service.engine.spec.tree_acceptance import ROOT, DraftTree


@dataclass(frozen=True)
class Drafted:
    tree: DraftTree
    q: torch.Tensor | None  # [n + 1, V] the distributions each node's children were drawn from (sampled
    # branches: row 0 the root's, row i + 1 node i's, over the target's vocabulary); None: top candidates


def draft_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int]) -> list[Drafted]:
    """Each sequence's draft tree of budgets[b] nodes (top candidates or sampled branches, by its
    policy's temperature), its width from its step's policy: one C call each (`Kernels.head_tree`,
    `Kernels.head_draft`). Trees run with the kernels only: the engine offers them nowhere else."""
    return [Drafted(_top_candidate_tree(rt, s, n), None) if s.step_policy.draft_temperature == 0
            else _sampled_branches(rt, s, n) for s, n in zip(seqs, budgets, strict=True)]


def ranking_temperature(rt: Runtime, seq: Sequence) -> float:
    """The temperature a top-candidate tree ranks its candidates at: what estimates a candidate's
    acceptance for this request (tree_calibration.py): the draft's calibrated tau for a greedy request,
    the request's own temperature for a sampled one."""
    sampling = seq.request.sampling
    return rt.tree_greedy_tau if sampling.greedy else sampling.temperature


def _top_candidate_tree(rt: Runtime, seq: Sequence, budget: int) -> DraftTree:
    head = rt.draft
    tokens, features = head_pending(rt, seq)
    taus = torch.full((budget,), ranking_temperature(rt, seq), dtype=torch.float32)  # (the kernel takes one a depth)
    picks, parents = head.kernels.head_tree(rt.head_chain, tokens, features, seq.slot, seq.draft_valid, budget,
                                            min(seq.step_policy.tree_width, budget), taus, head.kernel_threads.pool)
    seq.draft_valid = len(seq.ids)  # the catch-up's entries are true until the next verify
    return DraftTree(tuple(head.vocab[picks].tolist()), tuple(parents))


def _sampled_branches(rt: Runtime, seq: Sequence, budget: int) -> Drafted:
    """The first branch is the head's sampled chain of N - w + 1 drafts (one C call, `Kernels.head_draft`,
    the request's own uniforms); its first draft and w - 1 more drawn from the same q without replacement at
    the root are the root's children. The siblings are leaves: no head entry is run for them."""
    head, V = rt.draft, rt.target.cfg.vocab_size
    width = min(seq.step_policy.tree_width, budget)
    spine = budget - (width - 1)
    tokens, features = head_pending(rt, seq)
    uniforms = torch.rand(spine, generator=seq.gen)
    picks, q = head.kernels.head_draft(rt.head_chain, tokens, features, seq.slot, seq.draft_valid, spine,
                                       seq.step_policy.draft_temperature, uniforms, head.kernel_threads.pool)
    seq.draft_valid = len(seq.ids)  # the catch-up's entries are true until the next verify
    return sampled_branches(picks, q, width, seq.gen, head.vocab, V)


def sampled_branches(picks: torch.Tensor, q: torch.Tensor, width: int, gen: torch.Generator, vocab: torch.Tensor,
                     vocab_size: int) -> Drafted:
    """The tree of a sampled chain (draft indices picks [s], each drawn from q [s, Vd]) and up to
    width - 1 more draws from q[0] at the root, without replacement after the chain's first (drawn here,
    from gen; fewer where q[0] has no mass left); vocab [Vd] the target id of each draft index."""
    spine = picks.shape[0]
    siblings = distinct_draws(q[0], int(picks[0]), width - 1, gen)
    width = 1 + len(siblings)
    budget = spine + width - 1
    # Nodes by depth: the root's children (the chain's first draft, then the siblings), then the chain's rest.
    order = [int(picks[0]), *siblings, *picks[1:].tolist()]
    parents = [ROOT] * width + [0, *range(width, width + spine - 2)][:spine - 1]  # (the rest: each after the last)
    dq = torch.zeros(budget + 1, q.shape[1])
    dq[0] = q[0]  # the root's children's distribution
    if spine > 1:
        dq[1] = q[1]  # the chain's first draft's (its child's)
        dq[width + 1:width + spine - 1] = q[2:spine]
    return Drafted(DraftTree(tuple(vocab[torch.tensor(order)].tolist()), tuple(parents)),
                   torch.zeros(budget + 1, vocab_size).index_copy_(1, vocab, dq))


def distinct_draws(q: torch.Tensor, first: int, n: int, gen: torch.Generator) -> list[int]:
    """Up to n tokens drawn from q [Vd] after `first`, each from q with every token drawn so far taken
    out (sampling without replacement; it stops where no mass is left)."""
    left = q.clone()
    left[first] = 0.0
    drawn: list[int] = []
    for _ in range(n):
        if not float(left.sum()) > 0:
            break
        drawn.append(int(sample(left[None], gen)[0]))
        left[drawn[-1]] = 0.0
    return drawn
