"""Draft trees with an EAGLE-3 draft: the draft head's two tree shapes (tree_drafting.py), grown in torch.

After the catch-up (eagle3_drafting.catch_up), the entry at the last committed token (the root) gives the
first draft's distribution and the hidden state its children continue from. Then, by the policy's draft
temperature:

Temperature 0, the draft's top candidates, best first (EAGLE-2's tree, as the head grows it): every node
taken into the tree offers its w likeliest tokens as children, scored by their path's log-probability at
the ranking temperature (tree_drafting.ranking_temperature: the draft's calibrated tau for a greedy
request); the best-scored child not yet taken is taken next, until the budget N is reached. A child
never outscores its parent (log-probabilities are <= 0), so taking in score order gives the exact top N
by path score, parents before children. A taken node is expanded (one draft entry,
`Eagle3Draft.forward_node`) only while the tree needs more nodes; its entry reads its token and its
parent's output hidden, sits at a cache row of its own past the true entries, is roped at its depth and
attends the true entries and its path's rows: what a chain along that path would have read.

Temperature T > 0, sampled branches: EAGLE-3's sampled chain of N - w + 1 drafts
(eagle3_drafting.chain, the request's own uniforms) and w - 1 more draws from the root's q without replacement
(tree_drafting.sampled_branches).

Cache rows: with n committed tokens the true entries are rows 0..n-2 and node i's entry row n-1+i; the
scheduler marks every entry past the committed ones stale after the verify (Sequence.draft_valid), as it
does a chain's, so nothing a node wrote is read again.

Shape legend: w width, N node budget, Vd draft vocabulary, H hidden.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.eagle3_drafting import catch_up, chain
from service.engine.spec.tree_acceptance import ROOT, DraftTree
from service.engine.spec.tree_drafting import Drafted, ranking_temperature, sampled_branches


def draft_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int]) -> list[Drafted]:
    """Each sequence's tree of budgets[b] nodes (a one-token sequence, which has no draft entry yet,
    drafts none)."""
    roots = catch_up(rt, seqs)
    out = []
    with torch.no_grad():
        for b, (seq, budget) in enumerate(zip(seqs, budgets, strict=True)):
            if b not in roots:
                out.append(Drafted(DraftTree((), ()), None))
            elif seq.step_policy.draft_temperature == 0:
                out.append(Drafted(top_candidate_tree(rt, seq, *roots[b], budget), None))
            else:
                out.append(_sampled(rt, seq, *roots[b], budget))
    return out


def top_candidate_tree(rt: Runtime, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor,
                       budget: int) -> DraftTree:
    """logits [Vd] and hidden [H] of the root's entry -> the tree of the budget best candidates."""
    draft, embed, cache = rt.draft, rt.target.embed_tokens, rt.draft_cache
    target_ids = draft.target_ids
    width = min(seq.step_policy.tree_width, budget)
    tau = ranking_temperature(rt, seq)
    true_rows = len(seq.ids) - 1
    prefix = list(range(true_rows))
    order = itertools.count()  # ties go to the earlier candidate
    # (-path score, order, draft index, parent node, (parent's output hidden, parent's path rows, its depth))
    candidates: list[tuple] = []

    def offer(node_logits: torch.Tensor, score: float, parent: int, state: tuple) -> None:
        top = torch.log_softmax(node_logits.float() / tau, dim=-1).topk(width)
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            heapq.heappush(candidates, (-(score + value), next(order), index, parent, state))

    offer(logits, 0.0, ROOT, (hidden, [], 0))
    picks: list[int] = []
    parents: list[int] = []
    while candidates and len(picks) < budget:
        negative, _, index, parent, (parent_hidden, parent_rows, depth) = heapq.heappop(candidates)
        node = len(picks)
        picks.append(index)
        parents.append(parent)
        if len(picks) == budget:
            break
        rows = [*parent_rows, true_rows + node]
        node_logits, node_hidden = draft.forward_node(
            embed(target_ids[index]), parent_hidden, cache, seq.slot, true_rows + node, true_rows + depth,
            torch.tensor(prefix + rows))
        offer(node_logits, -negative, node, (node_hidden, rows, depth + 1))
    return DraftTree(tuple(target_ids[torch.tensor(picks, dtype=torch.long)].tolist()), tuple(parents))


def _sampled(rt: Runtime, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor, budget: int) -> Drafted:
    draft = rt.draft
    width = min(seq.step_policy.tree_width, budget)
    spine = budget - (width - 1)
    uniforms = torch.rand(spine, generator=seq.gen)
    picks, q = chain(draft, rt.target.embed_tokens, rt.draft_cache, seq.slot, len(seq.ids) - 1, spine, logits,
                     hidden, seq.step_policy.draft_temperature, uniforms, draft.target_ids)
    return sampled_branches(picks, q, width, seq.gen, draft.target_ids, rt.target.cfg.vocab_size)
