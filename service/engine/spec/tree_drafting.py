"""Draft trees with the draft head.

A tree policy has a width w and a node budget N (its draft_length). Per sequence, the head first
catches up on the entries its cache lacks; its last entry, at the last committed token (the root),
gives the distribution of the next token. Then, by the policy's draft temperature:

Temperature 0, the head's top candidates (EAGLE-2's dynamic tree), one C call per sequence
(`Kernels.head_tree`, csrc/head_tree.c):
- each depth: every node of the frontier offers its w likeliest tokens as children, scored by their
  path's log-probability (the sum along the path of each token's log-probability under the head, at the
  temperature that estimates its acceptance: `ranking_temperatures`, tree_calibration.py); the w
  best-scored new children form the next frontier, and the head runs on them in one pass (each at a
  head-cache row of its own past the root, attending the prefix and its path: kernels/attention.py);
- growth stops at depth N, or once no new child outscores the N-th best node so far (a descendant
  never scores above its ancestor, so none could enter the tree), or when the head cache has no row left;
- the tree is the N best-scored nodes of all children offered (ties to the earlier one): a node's
  ancestors outscore it, so it is a tree; where the head is sure, it is a chain.
The children are the head's top candidates, fixed given the context: the acceptance rule treats each
as a point mass (tree_acceptance.Children.TOP), which keeps sampled output exactly the target's.

Temperature T > 0, sampled branches (SpecInfer's), one head pass per depth over every such sequence:
the root's w children are drawn independently from the head's distribution q at T, and the first
continues as a chain of the remaining N - w nodes, one child drawn from q at each (`branch_lengths`).
The shape is fixed before anything is drawn, so every node's children are independent draws from its
q, and the acceptance rule reads q (tree_acceptance.Children.SAMPLED): a sampled request accepts one of
w draws at the root where a chain offers one. (A shape chosen from the draws, as the top-candidate tree
is, would bias them: that tree keeps point masses instead.)

Shape legend: w width, N node budget, Vd draft vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.model.ragged import RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.sampling import sample
from service.engine.spec.tree_acceptance import ROOT, DraftTree


@dataclass(frozen=True)
class Drafted:
    tree: DraftTree
    q: torch.Tensor | None  # [n + 1, V] the distributions each node's children were drawn from (sampled
    # branches: row 0 the root's, row i + 1 node i's, over the target's vocabulary); None: top candidates


def draft_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int]) -> list[Drafted]:
    """Each sequence's draft tree of budgets[b] nodes (top candidates or sampled branches, by its
    policy's temperature), its width from its step's policy. Trees run with the kernels only (the
    engine offers them nowhere else): a top-candidate tree is one C call per sequence
    (`Kernels.head_tree`), sampled branches one head pass per depth over every such sequence."""
    out: list[Drafted | None] = [None] * len(seqs)
    sampled = [j for j, s in enumerate(seqs) if s.step_policy.draft_temperature > 0]
    for j, (s, n) in enumerate(zip(seqs, budgets, strict=True)):
        if s.step_policy.draft_temperature == 0:
            out[j] = Drafted(_top_candidate_tree(rt, s, n), None)
    if sampled:
        logits, fhat = _catch_up(rt, [seqs[j] for j in sampled])
        drafted = _sampled_branches(rt, [seqs[j] for j in sampled], [budgets[j] for j in sampled], logits, fhat)
        for j, d in zip(sampled, drafted, strict=True):
            out[j] = d
    return out


def ranking_temperatures(rt: Runtime, seq: Sequence, budget: int) -> list[float]:
    """[budget] the temperature a top-candidate tree ranks depth d's candidates at (index d - 1): what
    estimates a candidate's acceptance for this request (tree_calibration.py): the head's calibrated
    tau of that depth for a greedy request, the request's own temperature for a sampled one."""
    sampling, taus = seq.request.sampling, rt.tree_greedy_taus
    return [taus[min(d, len(taus) - 1)] if sampling.greedy else sampling.temperature for d in range(budget)]


def _pending(rt: Runtime, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries a sequence's head cache lacks, up to the root: its tokens [m] and the target features
    they read [m, H] (entry p reads feature p - 1; zeros before the first)."""
    start = seq.draft_valid
    known = rt.target_features[seq.slot, max(start - 1, 0):len(seq.ids) - 1]
    features = known if start > 0 else torch.cat([known.new_zeros(1, known.shape[-1]), known])
    return torch.tensor(seq.ids[start:], dtype=torch.long), features


def _top_candidate_tree(rt: Runtime, seq: Sequence, budget: int) -> DraftTree:
    head = rt.draft
    tokens, features = _pending(rt, seq)
    taus = torch.tensor(ranking_temperatures(rt, seq, budget), dtype=torch.float32)
    picks, parents = head.kernels.head_tree(rt.head_chain, tokens, features, seq.slot, seq.draft_valid, budget,
                                            min(seq.step_policy.tree_width, budget), taus, head.kernel_threads.pool)
    seq.draft_valid = len(seq.ids)  # the catch-up's entries are true until the next verify
    return DraftTree(tuple(head.vocab[picks].tolist()), tuple(parents))


def _catch_up(rt: Runtime, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's entries each cache lacks, up to the root, in one pass -> the root's logits [B, Vd] and
    feature [B, H]."""
    pending = [_pending(rt, s) for s in seqs]
    lengths = [tokens.shape[0] for tokens, _ in pending]
    batch = RaggedBatch.build([s.slot for s in seqs], [s.draft_valid for s in seqs], lengths)
    logits, fhat = rt.draft.rows(rt.head_chain, rt.target.embed_tokens, torch.cat([t for t, _ in pending]),
                                 torch.cat([f for _, f in pending]), batch, rt.draft_cache,
                                 torch.tensor(lengths).cumsum(0) - 1)  # [B, Vd], [B, H]
    for s in seqs:
        s.draft_valid = len(s.ids)  # the catch-up's entries are true until the next verify
    return logits, fhat


def _head_pass(rt: Runtime, seqs: list[Sequence], tokens: list[int], features: torch.Tensor,
               paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on one node per row (target token ids, the parent's feature [R, H]) at the head-cache
    rows ending each path -> logits [R, Vd], features [R, H]."""
    batch = RaggedBatch.build([s.slot for s in seqs], [p[-1] for p in paths], [1] * len(paths), paths=paths)
    return rt.draft.rows(rt.head_chain, rt.target.embed_tokens, torch.tensor(tokens), features, batch, rt.draft_cache,
                         torch.arange(len(paths)))


def branch_lengths(budget: int, width: int) -> list[int]:
    """The first branch takes what the w - 1 one-node siblings beside it leave: a sibling at the root is
    tried only after the first draw there is rejected, while each node deeper along the first branch
    follows an accepted one, so the budget goes deep first (an even split accepted ~40% less per pass
    on the shipped pair, whose head is accepted ~65% of the time at T=0.8)."""
    w = min(width, budget)
    return [budget - (w - 1), *([1] * (w - 1))]


def _sampled_branches(rt: Runtime, seqs: list[Sequence], budgets: list[int], logits: torch.Tensor,
                      fhat: torch.Tensor) -> list[Drafted]:
    """w branches from the root, every node drawn from its parent's q at the policy's temperature with
    the request's own generator; the branches advance together, one head pass per depth."""
    head, V = rt.draft, rt.target.cfg.vocab_size
    out = []
    qs: list[list[torch.Tensor]] = []  # per sequence: [q of the root, q of node 0, ...] over the draft vocabulary
    branches: list[list[list[int]]] = []  # per sequence, per branch: its nodes
    tokens: list[list[int]] = []
    parents: list[list[int]] = []
    for j, (s, n) in enumerate(zip(seqs, budgets, strict=True)):
        T = s.step_policy.draft_temperature
        q = (logits[j].float() / T).softmax(-1)
        picks = sample(q[None].expand(min(s.step_policy.tree_width, n), -1), s.gen)  # i.i.d. draws at the root
        tokens.append([int(head.vocab[p]) for p in picks.tolist()])
        parents.append([ROOT] * len(tokens[-1]))
        branches.append([[i] for i in range(len(tokens[-1]))])
        qs.append([q])
    lengths = [branch_lengths(n, s.step_policy.tree_width) for s, n in zip(seqs, budgets, strict=True)]
    feature = {(j, ROOT): fhat[j] for j in range(len(seqs))}
    rows = {(j, ROOT): [len(s.ids) - 1] for j, s in enumerate(seqs)}
    for depth in range(1, max(max(ls) for ls in lengths)):
        growing = [(j, b) for j in range(len(seqs)) for b, n in enumerate(lengths[j]) if n > depth]
        if not growing:
            break
        nodes = [(j, branches[j][b][-1]) for j, b in growing]
        for j, c in nodes:  # its head row: one past the root per node drafted so far (rows never collide)
            rows[j, c] = [*rows[j, parents[j][c]], len(seqs[j].ids) + c]
        logits_d, fhat_d = _head_pass(rt, [seqs[j] for j, _ in nodes], [tokens[j][c] for j, c in nodes],
                                      torch.stack([feature[j, parents[j][c]] for j, c in nodes]),
                                      [rows[j, c] for j, c in nodes])
        for r, ((j, b), (_, c)) in enumerate(zip(growing, nodes, strict=True)):
            feature[j, c] = fhat_d[r]
            q = (logits_d[r].float() / seqs[j].step_policy.draft_temperature).softmax(-1)
            pick = int(sample(q[None], seqs[j].gen)[0])
            tokens[j].append(int(head.vocab[pick]))
            parents[j].append(c)
            branches[j][b].append(len(tokens[j]) - 1)
            while len(qs[j]) < c + 2:
                qs[j].append(None)
            qs[j][c + 1] = q
    for j in range(len(seqs)):
        # Parents before children: by depth, then branch (the drafting order above interleaves them).
        depth_of = {i: d for branch in branches[j] for d, i in enumerate(branch)}
        order = sorted(range(len(tokens[j])), key=lambda i: (depth_of[i], i))
        index = {c: i for i, c in enumerate(order)}
        tree = DraftTree(tuple(tokens[j][c] for c in order),
                         tuple(ROOT if parents[j][c] == ROOT else index[parents[j][c]] for c in order))
        dq = torch.zeros(len(order) + 1, head.vocab.shape[0])
        dq[0] = qs[j][0]
        for c in order:
            if c + 1 < len(qs[j]) and qs[j][c + 1] is not None:
                dq[index[c] + 1] = qs[j][c + 1]
        out.append(Drafted(tree, torch.zeros(dq.shape[0], V).index_copy_(1, head.vocab, dq)))
    return out
