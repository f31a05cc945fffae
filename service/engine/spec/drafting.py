"""Each running sequence's proposal for one scheduler step, under its own draft policy.

A sequence's controller (adaptive/) says how many drafts to draft (`plan`); an n-gram sequence
looks its drafts up in its own tokens (ngram.py; q is a point mass on each draft); the sequences
that draft with the model run together, batched, in the model drafter's rounds (model_drafting.py:
the dense draft model or the draft head). Where the controller asks, the drafter reports its
confidences and the controller keeps a prefix of the drafts (`cut`). Apart from the scheduler's
loop: the loop decides which sequences run a step; this decides what each of them proposes.

Shape legend: k' drafts proposed, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec import eagle3_drafting, eagle3_trees, model_drafting, ngram, tree_drafting
from service.engine.spec.adaptive.controller import DraftConfidence, adapts
from service.engine.spec.sampling import point_mass
from service.engine.spec.tree_acceptance import DraftTree
from service.types import Drafter


@dataclass
class Proposal:
    drafts: list[int]  # [k'] the drafts to verify
    # [k', V] the distributions they were drawn from (None: nothing drafted, or a greedy request's
    # n-gram drafts: a greedy verdict reads no q)
    q: torch.Tensor | None
    seconds: float  # drafting time (the model drafter's rounds are shared by the sequences in them)
    confidence: DraftConfidence | None = None  # of the drafts verified, where the drafter reports it
    planned: int = 0  # drafts the controller asked for (after its cut, for the model drafter)
    tree: DraftTree | None = None  # a tree policy's drafts (drafts = its nodes' tokens); None: a chain

    @property
    def window_parents(self) -> list[int] | None:
        """The verify window's tree (RaggedBatch's `trees`: -1 for the last committed token, then each
        node's parent by window index), or None for a chain (a tree shaped as one included)."""
        if self.tree is None or self.tree.is_chain:
            return None  # (a tree that came out a chain verifies as one: no paths to build or check)
        return [-1, *(p + 1 for p in self.tree.parents)]


def uses_head(seq: Sequence) -> bool:
    """The sequence may draft with the model drafter (a draft head, where the engine has one) in
    some step: its draft cache (or the target features a head reads) must follow its tokens."""
    return seq.may_draft_with_model


def draft(rt: Runtime, seqs: list[Sequence]) -> list[Proposal]:
    """Each sequence's proposal under its own policy and controller; the draft model runs batched."""
    vocab = rt.target.cfg.vocab_size
    out: list[Proposal] = []
    model_rows: list[tuple[int, int]] = []  # (index in seqs, k)
    tree_rows: list[tuple[int, int]] = []  # (index in seqs, node budget): tree policies
    fed = 0  # positions the model drafter feeds this step: each row's catch-up, then a round per later draft
    for i, seq in enumerate(seqs):
        k = limit = seq.draft_budget()
        # Tokens its model-drafter cache lacks: its first draft round feeds them (0 when it cannot draft).
        lag = len(seq.ids) - seq.draft_valid if limit > 0 and seq.step_policy.drafter is Drafter.MODEL else 0
        if limit > 0 and adapts(seq.controller):
            k = seq.controller.plan(rt.adaptive.context(len(seqs), seq.last_window, lag), limit)
        t0 = time.perf_counter()
        if k > 0 and seq.step_policy.drafter is Drafter.NGRAM:
            if seq.ngram is None:
                seq.ngram = ngram.NgramIndex(*rt.ngram_sizes)
            drafts = seq.ngram.propose(seq.ids, k)
            seconds = time.perf_counter() - t0
            rt.adaptive.observe_lookup(seconds)
            # A greedy request's verdict is a prefix match that reads no q: the [k, V] point mass is
            # built only for sampled requests (at 16 requests a step it was most of the drafting time).
            q = None if seq.request.sampling.greedy else point_mass(torch.tensor(drafts, dtype=torch.long), vocab)
            out.append(Proposal(drafts, q, seconds, planned=k))
        else:
            out.append(Proposal([], None, 0.0, planned=k))
            if k > 1 and seq.step_policy.tree_width > 1:  # (one node is a chain of one)
                tree_rows.append((i, k))
            elif k > 0:
                model_rows.append((i, k))
                fed += lag + k - 1
    if tree_rows:  # (static policies only: no controller plans or cuts a tree)
        t0 = time.perf_counter()
        grow = eagle3_trees.draft_trees if rt.draft_is_eagle3 else tree_drafting.draft_trees
        trees = grow(rt, [seqs[i] for i, _ in tree_rows], [k for _, k in tree_rows])
        seconds = time.perf_counter() - t0
        for (i, k), drafted in zip(tree_rows, trees, strict=True):  # (a tree's q: [n + 1, V], tree_drafting.py)
            out[i] = Proposal(list(drafted.tree.tokens), drafted.q, seconds, planned=k, tree=drafted.tree)
    if model_rows:
        t0 = time.perf_counter()
        draft_rounds = (model_drafting.draft_with_head if rt.draft_is_head
                        else eagle3_drafting.draft_with_eagle3 if rt.draft_is_eagle3 else model_drafting.draft_dense)
        rows = [seqs[i] for i, _ in model_rows]
        drafted = draft_rounds(rt, rows, [k for _, k in model_rows], [s.controller.wants_confidence for s in rows])
        seconds = time.perf_counter() - t0
        rt.adaptive.observe_draft_positions(fed, seconds)
        for (i, _), (drafts, q, confidence) in zip(model_rows, drafted, strict=True):
            out[i] = _cut(seqs[i], Proposal(drafts.tolist(), q, seconds, confidence, planned=len(drafts)))
    return out


def _cut(seq: Sequence, proposal: Proposal) -> Proposal:
    """The prefix of the drafts the sequence's controller keeps, given the drafter's confidences."""
    if proposal.confidence is None:
        return proposal
    k = seq.controller.cut(proposal.confidence)
    if k >= len(proposal.drafts):
        return proposal
    c = proposal.confidence
    return Proposal(proposal.drafts[:k], proposal.q[:k] if k else None, proposal.seconds,
                    DraftConfidence(c.token[:k], c.top[:k]) if k else None, planned=k)
