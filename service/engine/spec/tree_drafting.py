"""Draft trees with the draft head, batched over the sequences that draft them.

A tree policy has a width w and a node budget N (its draft_length). Per sequence, the head first
catches up on the entries its cache lacks (one ragged pass over every tree sequence); its last entry,
at the last committed token (the root), gives the distribution of the next token. Then, by the
policy's draft temperature:

Temperature 0, the head's top candidates (EAGLE-2's dynamic tree):
- each depth: every node of the frontier offers its w likeliest tokens as children, scored by their
  path's log-probability (the sum along the path of each token's log-probability under the head); the
  w best-scored new children form the next frontier,
  and the head runs on them in ONE ragged pass over every tree sequence (each node at a head-cache row
  of its own past the root, attending the prefix and its path: kernels/attention.py's trees);
- growth stops at depth N, or once no new child outscores the N-th best node so far (a descendant
  never scores above its ancestor, so none could enter the tree), or when the head cache has no row left;
- the tree is the N best-scored nodes of all children offered (ties to the earlier one): a node's
  ancestors outscore it, so it is a tree, and a chain is the tree of width 1.
The children are the head's top candidates, fixed given the context: the acceptance rule treats each
as a point mass (tree_acceptance.Children.TOP), which keeps sampled output exactly the target's.

Temperature T > 0, sampled branches (SpecInfer's): the root's w children are drawn independently from
the head's distribution q at T, and each continues as a chain, one child drawn from q at each of its
nodes, the N nodes split over the w branches as evenly as they go (the first ones one longer). The
shape is fixed before anything is drawn, so every node's children are independent draws from its q
and the acceptance rule reads q (tree_acceptance.Children.SAMPLED): a sampled request accepts one of
w draws at the root where a chain offers one. (A shape chosen from the draws, as the top-candidate
tree is, would bias them: that tree keeps point masses instead.)

Shape legend: w width, N node budget, Vd draft vocabulary, H hidden.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from service.engine.model.ragged import RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.sampling import sample
from service.engine.spec.tree_acceptance import ROOT, DraftTree


@dataclass
class _Grown:
    """One sequence's tree while it grows: every child offered so far, and the frontier the head runs on."""

    root_row: int  # the head-cache row of the root entry (the last committed token's position)
    budget: int
    width: int
    tokens: list[int]  # [c] each child offered: its target token id
    parents: list[int]  # [c] its parent (an earlier child, or ROOT)
    scores: list[float]  # [c] its path's log-probability
    frontier: list[int]  # children whose head entries are run next (their logits give the next depth)
    rows: dict[int, list[int]]  # expanded child -> its head-cache path (root row first, its own row last)
    done: bool = False

    def offer(self, parent: int, log_probs: torch.Tensor, vocab: torch.Tensor) -> list[int]:
        """The w likeliest children of `parent` (ROOT or an expanded child) from its log-probs [Vd]."""
        base = 0.0 if parent == ROOT else self.scores[parent]
        top = torch.topk(log_probs, self.width)
        new = []
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            self.tokens.append(int(vocab[index]))
            self.parents.append(parent)
            self.scores.append(base + value)
            new.append(len(self.tokens) - 1)
        return new

    def kth_best(self) -> float:
        """The N-th best score offered so far (-inf while fewer were offered)."""
        return heapq.nlargest(self.budget, self.scores)[-1] if len(self.scores) >= self.budget else -math.inf

    def tree(self) -> DraftTree:
        """The N best-scored children (ties to the earlier), parents before children."""
        order = sorted(range(len(self.scores)), key=lambda c: (-self.scores[c], c))[:self.budget]
        kept = sorted(order, key=lambda c: (self._depth(c), c))
        index = {c: i for i, c in enumerate(kept)}
        return DraftTree(tuple(self.tokens[c] for c in kept),
                         tuple(ROOT if self.parents[c] == ROOT else index[self.parents[c]] for c in kept))

    def _depth(self, c: int) -> int:
        d = 0
        while c != ROOT:
            c, d = self.parents[c], d + 1
        return d


@dataclass(frozen=True)
class Drafted:
    tree: DraftTree
    q: torch.Tensor | None  # [n + 1, V] the distributions each node's children were drawn from (sampled
    # branches: row 0 the root's, row i + 1 node i's, over the target's vocabulary); None: top candidates


def draft_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int]) -> list[Drafted]:
    """Each sequence's draft tree of budgets[b] nodes (top candidates or sampled branches, by its
    policy's temperature), its width from its step's policy."""
    logits, fhat = _catch_up(rt, seqs)
    out: list[Drafted | None] = [None] * len(seqs)
    top = [j for j, s in enumerate(seqs) if s.step_policy.draft_temperature == 0]
    sampled = [j for j, s in enumerate(seqs) if s.step_policy.draft_temperature > 0]
    if top:
        trees = _top_candidate_trees(rt, [seqs[j] for j in top], [budgets[j] for j in top], logits[top], fhat[top])
        for j, tree in zip(top, trees, strict=True):
            out[j] = Drafted(tree, None)
    if sampled:
        drafted = _sampled_branches(rt, [seqs[j] for j in sampled], [budgets[j] for j in sampled], logits[sampled],
                                    fhat[sampled])
        for j, d in zip(sampled, drafted, strict=True):
            out[j] = d
    return out


def _catch_up(rt: Runtime, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's entries each cache lacks, up to the root -> the root's logits [B, Vd] and feature [B, H]."""
    head, embed = rt.draft, rt.target.embed_tokens
    # The catch-up: the entries each head cache lacks, up to the root (as the head's chains do).
    pending, features, starts = [], [], []
    for s in seqs:
        start = s.draft_valid
        pending.append(torch.tensor(s.ids[start:], dtype=torch.long))
        known = rt.target_features[s.slot, max(start - 1, 0):len(s.ids) - 1]  # entry p reads feature p - 1
        features.append(known if start > 0 else torch.cat([known.new_zeros(1, known.shape[-1]), known]))
        starts.append(start)
    lengths = [p.shape[0] for p in pending]
    batch = RaggedBatch.build([s.slot for s in seqs], starts, lengths)
    logits, fhat = head.forward_ragged(embed(torch.cat(pending)), torch.cat(features), batch, rt.draft_cache,
                                       torch.tensor(lengths).cumsum(0) - 1)  # [B, Vd], [B, H]
    for s in seqs:
        s.draft_valid = len(s.ids)  # the catch-up's entries are true until the next verify
    return logits, fhat


def _head_pass(rt: Runtime, seqs: list[Sequence], tokens: list[int], features: torch.Tensor,
               paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on one node per row (target token ids, the parent's feature [R, H]) at the head-cache
    rows ending each path -> logits [R, Vd], features [R, H]."""
    batch = RaggedBatch.build([s.slot for s in seqs], [p[-1] for p in paths], [1] * len(paths), paths=paths)
    return rt.draft.forward_ragged(rt.target.embed_tokens(torch.tensor(tokens)), features, batch, rt.draft_cache,
                                   torch.arange(len(paths)))


def _top_candidate_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int], logits: torch.Tensor,
                         fhat: torch.Tensor) -> list[DraftTree]:
    head = rt.draft
    rows_left = rt.draft_cache.max_len
    grown = []
    for j, (s, n) in enumerate(zip(seqs, budgets, strict=True)):
        policy = s.step_policy
        g = _Grown(len(s.ids) - 1, n, min(policy.tree_width, n), [], [], [], [], {})
        g.frontier = g.offer(ROOT, torch.log_softmax(logits[j].float(), dim=-1), head.vocab)
        g.rows = {}
        grown.append(g)
    parent_feature = {(j, ROOT): fhat[j] for j in range(len(seqs))}
    for depth in range(1, max(budgets)):
        active = [j for j, g in enumerate(grown) if not g.done and depth < g.budget and g.frontier]
        # The frontier's entries: each at a head-cache row of its own past the root, while rows are left.
        nodes = []  # (sequence index, child)
        for j in active:
            g = grown[j]
            for c in g.frontier:
                row = g.root_row + 1 + len(g.rows)
                if row >= rows_left:
                    g.done = True
                    break
                parent = g.parents[c]
                g.rows[c] = [*(g.rows[parent] if parent != ROOT else [g.root_row]), row]
                nodes.append((j, c))
        nodes = [(j, c) for j, c in nodes if c in grown[j].rows]
        if not nodes:
            break
        parent_features = torch.stack([parent_feature[(j, grown[j].parents[c])] for j, c in nodes])
        logits, fhat = _head_pass(rt, [seqs[j] for j, _ in nodes], [grown[j].tokens[c] for j, c in nodes],
                                  parent_features, [grown[j].rows[c] for j, c in nodes])  # [R, Vd], [R, H]
        offered: dict[int, list[int]] = {}
        for r, (j, c) in enumerate(nodes):
            parent_feature[(j, c)] = fhat[r]
            g = grown[j]
            offered.setdefault(j, []).extend(g.offer(c, torch.log_softmax(logits[r].float(), dim=-1), head.vocab))
        for j in {j for j, _ in nodes}:
            g = grown[j]
            new = sorted(offered[j], key=lambda c: (-g.scores[c], c))
            # No new child outscores the N-th best: none of their descendants could enter the tree.
            if g.scores[new[0]] < g.kth_best():
                g.done = True
            g.frontier = new[:g.width]
    return [g.tree() for g in grown]


def branch_lengths(budget: int, width: int) -> list[int]:
    """N nodes over w branches as evenly as they go, the first ones one longer."""
    w = min(width, budget)
    return [budget // w + (1 if b < budget % w else 0) for b in range(w)]


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
