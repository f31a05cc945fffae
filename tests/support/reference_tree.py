"""The top-candidate draft tree grown in Python, step by step, as an independent reference for the C
kernel (`Kernels.head_tree`, csrc/head_tree.c): the same rule written another way (torch's log-softmax
and top-k per depth, the head's rows through `DraftHead.rows`), so a test can hold the kernel's trees to
it. See service/engine/spec/tree_drafting.py for the rule. The head runs through
`DraftHead.forward_ragged` (the torch path over the kernels), not the C tree's own loop."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from service.engine.model.ragged import RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.tree_acceptance import ROOT, DraftTree
from service.engine.spec.tree_drafting import _pending


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

    def offer(self, parent: int, values: list[float], tokens: list[int]) -> list[int]:
        """Children of `parent` (ROOT or an expanded child): its w likeliest tokens (target ids) and their
        log-probabilities, best first."""
        base = 0.0 if parent == ROOT else self.scores[parent]
        new = []
        for value, token in zip(values[:self.width], tokens[:self.width], strict=True):
            self.tokens.append(token)
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




def _top_candidates(rt: Runtime, seqs: list[Sequence], logits: torch.Tensor, width: int, vocab: list[int],
                    depth: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's `width` likeliest draft tokens (target ids) at `depth` and their log-probabilities under
    the request's acceptance: a greedy request's at the head's calibrated tau for that depth, a sampled
    one's at its own temperature (tree_calibration.py), best first."""
    greedy_tau = rt.tree_greedy_taus[min(depth, len(rt.tree_greedy_taus)) - 1]
    tau = torch.tensor([[greedy_tau if s.request.sampling.greedy else s.request.sampling.temperature]
                        for s in seqs])
    top = torch.log_softmax(logits.float() / tau, dim=-1).topk(width, dim=-1)
    return top.values.tolist(), [[vocab[i] for i in row] for row in top.indices.tolist()]


def top_candidate_trees(rt: Runtime, seqs: list[Sequence], budgets: list[int]) -> list[DraftTree]:
    logits, fhat = _catch_up(rt, seqs)
    vocab = rt.draft.vocab.tolist()
    rows_left = rt.draft_cache.max_len
    width = max(min(s.step_policy.tree_width, n) for s, n in zip(seqs, budgets, strict=True))
    grown = []
    values, tokens = _top_candidates(rt, seqs, logits, width, vocab, 1)
    for j, (s, n) in enumerate(zip(seqs, budgets, strict=True)):
        g = _Grown(len(s.ids) - 1, n, min(s.step_policy.tree_width, n), [], [], [], [], {})
        g.frontier = g.offer(ROOT, values[j], tokens[j])
        grown.append(g)
    parent_feature = {(j, ROOT): fhat[j] for j in range(len(seqs))}
    for depth in range(1, max(budgets)):
        # The frontier's entries: each at a head-cache row of its own past the root, while rows are left.
        nodes = []  # (sequence index, child)
        for j, g in enumerate(grown):
            if g.done or depth >= g.budget:
                continue
            for c in g.frontier:
                row = g.root_row + 1 + len(g.rows)
                if row >= rows_left:
                    g.done = True
                    break
                parent = g.parents[c]
                g.rows[c] = [*(g.rows[parent] if parent != ROOT else [g.root_row]), row]
                nodes.append((j, c))
        if not nodes:
            break
        parent_features = torch.stack([parent_feature[(j, grown[j].parents[c])] for j, c in nodes])
        logits, fhat = _head_pass(rt, [seqs[j] for j, _ in nodes], [grown[j].tokens[c] for j, c in nodes],
                                  parent_features, [grown[j].rows[c] for j, c in nodes])  # [R, Vd], [R, H]
        values, tokens = _top_candidates(rt, [seqs[j] for j, _ in nodes], logits, width, vocab, depth + 1)
        offered: dict[int, list[int]] = {}
        for r, (j, c) in enumerate(nodes):
            parent_feature[(j, c)] = fhat[r]
            offered.setdefault(j, []).extend(grown[j].offer(c, values[r], tokens[r]))
        for j, new in offered.items():
            g = grown[j]
            new.sort(key=lambda c: (-g.scores[c], c))
            # A child below the N-th best is not expanded: none of its descendants could enter the tree.
            kth = g.kth_best()
            g.frontier = [c for c in new[:g.width] if g.scores[c] >= kth]
            g.done = not g.frontier
    return [g.tree() for g in grown]


def _catch_up(rt: Runtime, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's entries each cache lacks, up to the root, in one pass -> the root's logits [B, Vd] and
    feature [B, H]."""
    pending = [_pending(rt, s) for s in seqs]
    lengths = [tokens.shape[0] for tokens, _ in pending]
    batch = RaggedBatch.build([s.slot for s in seqs], [s.draft_valid for s in seqs], lengths)
    logits, fhat = rt.draft.forward_ragged(rt.target.embed_tokens(torch.cat([t for t, _ in pending])),
                                           torch.cat([f for _, f in pending]), batch, rt.draft_cache,
                                           torch.tensor(lengths).cumsum(0) - 1)  # [B, Vd], [B, H]
    for s in seqs:
        s.draft_valid = len(s.ids)
    return logits, fhat


def _head_pass(rt: Runtime, seqs: list[Sequence], tokens: list[int], features: torch.Tensor,
               paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on one node per row (target token ids, the parent's feature [R, H]) at the head-cache
    rows ending each path -> logits [R, Vd], features [R, H]."""
    batch = RaggedBatch.build([s.slot for s in seqs], [p[-1] for p in paths], [1] * len(paths), paths=paths)
    return rt.draft.forward_ragged(rt.target.embed_tokens(torch.tensor(tokens)), features, batch, rt.draft_cache,
                                   torch.arange(len(paths)))
