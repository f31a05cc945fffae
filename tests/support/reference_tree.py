"""The top-candidate draft tree grown in Python, step by step, as an independent reference for the C
kernel (`Kernels.head_tree`, csrc/head_tree.c): the same rule written another way (torch's log-softmax
and top-k per depth, the head's rows through `DraftHead.rows`), so a test can hold the kernel's trees to
it. See service/engine/spec/tree_drafting.py for the rule. The head runs through
`DraftHead.forward_ragged` (the torch path over the kernels), not the C tree's own loop."""

from __future__ import annotations

import torch

from service.engine.model.ragged import RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.model_drafting import head_pending
from service.engine.spec.tree_acceptance import ROOT, DraftTree


def _top_candidates(rt: Runtime, seq: Sequence, logits: torch.Tensor, width: int, vocab: list[int],
                    depth: int) -> tuple[list[float], list[int]]:
    """The `width` likeliest draft tokens (target ids) at `depth` and their log-probabilities under the
    request's acceptance: a greedy request's at the head's calibrated tau for that depth, a sampled one's
    at its own temperature (tree_calibration.py), best first."""
    sampling = seq.request.sampling
    tau = rt.tree_greedy_tau if sampling.greedy else sampling.temperature
    top = torch.log_softmax(logits.float() / tau, dim=-1).topk(width)
    return top.values.tolist(), [vocab[i] for i in top.indices.tolist()]


def top_candidate_tree(rt: Runtime, seq: Sequence, budget: int) -> DraftTree:
    """Best first: expand the best candidate not yet expanded (one head row per pass) while it scores at
    least the budget-th best offered so far; the tree is the budget best candidates."""
    logits, fhat = _catch_up(rt, [seq])
    vocab = rt.draft.vocab.tolist()
    width = min(seq.step_policy.tree_width, budget)
    root_row = len(seq.ids) - 1
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    rows: dict[int, list[int]] = {ROOT: [root_row]}  # expanded candidate -> its head-cache path
    features = {ROOT: fhat[0]}

    def offer(parent: int, row_logits: torch.Tensor) -> None:
        depth = 1 if parent == ROOT else depths[parent] + 1
        values, ids = _top_candidates(rt, seq, row_logits, width, vocab, depth)
        for value, token in zip(values, ids, strict=True):
            tokens.append(token)
            parents.append(parent)
            scores.append((0.0 if parent == ROOT else scores[parent]) + value)
            depths.append(depth)

    def best_first(candidates) -> list[int]:
        return sorted(candidates, key=lambda c: (-scores[c], c))

    offer(ROOT, logits[0])
    for expanded in range(1, budget + 1):
        if root_row + expanded >= rt.draft_cache.max_len:
            break
        open_ = [c for c in range(len(tokens)) if c not in rows and depths[c] < budget]
        if not open_:
            break
        best = best_first(open_)[0]
        if len(scores) >= budget and scores[best] < scores[best_first(range(len(scores)))[budget - 1]]:
            break
        rows[best] = [*rows[parents[best]], root_row + expanded]
        row_logits, fhat = _head_pass(rt, [seq], [tokens[best]], features[parents[best]][None], [rows[best]])
        features[best] = fhat[0]
        offer(best, row_logits[0])
    kept = sorted(best_first(range(len(tokens)))[:budget], key=lambda c: (depths[c], c))
    index = {c: i for i, c in enumerate(kept)}
    return DraftTree(tuple(tokens[c] for c in kept),
                     tuple(ROOT if parents[c] == ROOT else index[parents[c]] for c in kept))


def _catch_up(rt: Runtime, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's entries each cache lacks, up to the root, in one pass -> the root's logits [B, Vd] and
    feature [B, H]."""
    pending = [head_pending(rt, s) for s in seqs]
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
