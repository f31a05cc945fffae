"""The model drafter's rounds for one scheduler step, batched over the sequences that use it.

Round r is one ragged pass over the sequences still drafting (k_b > r); each first catches up on
the entries its draft cache lacks (`Sequence.draft_valid` says how many it holds). Two kinds of
draft, chosen by the draft directory:
- a dense draft model (`Transformer`): its cache entries depend on the tokens only, so entries of
  accepted drafts stay valid after verification;
- the draft head (`DraftHead`): an entry also reads the target's feature one position back, and the
  features of drafted positions were the head's own estimates, so after verification every entry
  past the last committed token is recomputed from the target's true features (written per slot
  and position by the model runner into `Runtime.target_features`).
Each returns, per sequence, the drafted token ids [k], q [k, V]: the distribution each draft
was sampled from (a point mass for a greedy draft), which the acceptance rule needs, and, for the
sequences whose controller asks, the drafts' confidences (`draft_confidence`; None where the
drafter has no probabilities to give: the draft head's greedy chain returns only its picks).
"""

from __future__ import annotations

import torch

from service.engine.model.draft_head import DraftHead
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.adaptive.controller import DraftConfidence
from service.engine.spec.sampling import draft_probs, point_mass, sample

Drafted = tuple[torch.Tensor, torch.Tensor, DraftConfidence | None]


def draft_confidence(probs: torch.Tensor, picks: torch.Tensor) -> DraftConfidence:
    """probs [k, V] the distributions the drafts came from, picks [k] the drafts: their
    probabilities and each distribution's largest (fixed before its draft was drawn)."""
    return DraftConfidence(tuple(probs.gather(1, picks[:, None].long())[:, 0].tolist()),
                           tuple(probs.max(-1).values.tolist()))


def draft_dense(rt: Runtime, seqs: list[Sequence], ks: list[int], confident: list[bool]) -> list[Drafted]:
    """confident[b]: report sequence b's confidences (from the draft's softmax at its temperature;
    at temperature 0, at temperature 1: a point mass says nothing)."""
    pending = [torch.tensor(s.ids[s.draft_valid:], dtype=torch.long) for s in seqs]  # tokens each still has to feed
    starts = [s.draft_valid for s in seqs]
    drafts: list[list[torch.Tensor]] = [[] for _ in seqs]
    qs: list[list[torch.Tensor]] = [[] for _ in seqs]
    soft: list[list[torch.Tensor]] = [[] for _ in seqs]  # the distributions confidences are read from
    for r in range(max(ks)):
        active = [b for b, k in enumerate(ks) if k > r]
        lengths = [pending[b].shape[0] for b in active]
        batch = RaggedBatch.build([seqs[b].slot for b in active], [starts[b] for b in active], lengths)
        last_rows = torch.tensor(lengths).cumsum(0) - 1  # each sequence's last position: the only logits read
        last = rt.draft.forward_ragged(torch.cat([pending[b] for b in active]), batch, rt.draft_cache,
                                      logit_rows=last_rows).logits  # [B', V]
        for j, b in enumerate(active):
            row = last[j:j + 1]  # [1, V]
            temperature = seqs[b].step_policy.draft_temperature
            q = draft_probs(row, temperature)
            # A greedy draft's q is a point mass: its argmax is the sample, no random draw needed.
            token = row.argmax(-1) if temperature == 0 else sample(q, seqs[b].gen)
            drafts[b].append(token)
            qs[b].append(q)
            if confident[b]:
                soft[b].append(row.float().softmax(-1) if temperature == 0 else q)
            starts[b] += pending[b].shape[0]
            pending[b] = token
    out = []
    for d, q, c in zip(drafts, qs, soft, strict=True):
        picks = torch.cat(d)
        out.append((picks, torch.cat(q), draft_confidence(torch.cat(c), picks) if c else None))
    return out


def draft_with_head(rt: Runtime, seqs: list[Sequence], ks: list[int], confident: list[bool]) -> list[Drafted]:
    """confident[b]: report sequence b's confidences where its chain samples (its q).

    With the kernels, each sequence's catch-up and chain is one C call (`Kernels.head_draft`: the
    calls are independent, so a sequence's drafts never depend on the rest of the batch); without,
    the catch-up is one ragged pass over every sequence and the chains run in torch ops."""
    head, vocab_size = rt.draft, rt.target.cfg.vocab_size
    pending, features = zip(*(head_pending(rt, s) for s in seqs), strict=True)
    uniforms = [torch.rand(k, generator=s.gen) if s.step_policy.draft_temperature > 0 else None
                for s, k in zip(seqs, ks, strict=True)]
    if rt.head_chain is not None:
        chains = [head.kernels.head_draft(rt.head_chain, tokens, f, s.slot, s.draft_valid, k,
                                          s.step_policy.draft_temperature, u, head.kernel_threads.pool)
                  for s, k, tokens, f, u in zip(seqs, ks, pending, features, uniforms, strict=True)]
    else:
        lengths = [p.shape[0] for p in pending]
        batch = RaggedBatch.build([s.slot for s in seqs], [s.draft_valid for s in seqs], lengths)
        logits, fhat = head.forward_ragged(rt.target.embed_tokens(torch.cat(pending)), torch.cat(features), batch,
                                           rt.draft_cache, torch.tensor(lengths).cumsum(0) - 1)  # [B, Vd], [B, H]
        chains = [chain_reference(head, rt.target.embed_tokens, rt.draft_cache, s.slot, len(s.ids), k, logits[j],
                                  fhat[j], s.step_policy.draft_temperature, u)
                  for j, (s, k, u) in enumerate(zip(seqs, ks, uniforms, strict=True))]
    out = []
    for (picks, q), want in zip(chains, confident, strict=True):
        drafts = head.vocab[picks]
        if q is None:
            out.append((drafts, point_mass(drafts, vocab_size), None))
        else:  # over the target's vocabulary: zero outside the draft vocabulary
            out.append((drafts, torch.zeros(q.shape[0], vocab_size).index_copy_(1, head.vocab, q),
                        draft_confidence(q, picks) if want else None))
    return out


def head_pending(rt: Runtime, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries a sequence's head cache lacks, up to its last committed token: their tokens [m] and the
    target features they read [m, H] (entry p reads feature p - 1; zeros before the first)."""
    start = seq.draft_valid
    known = rt.target_features[seq.slot, max(start - 1, 0):len(seq.ids) - 1]
    features = known if start > 0 else torch.cat([known.new_zeros(1, known.shape[-1]), known])
    return torch.tensor(seq.ids[start:], dtype=torch.long), features


def chain_reference(head: DraftHead, embed: torch.nn.Embedding, cache: KVCache, slot: int, position: int, k: int,
                    logits: torch.Tensor, feature: torch.Tensor, temperature: float,
                    uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Kernels.head_draft`'s chain in torch ops (after a catch-up whose last row gave logits [Vd] and
    feature [H]; the chain's entries go to positions position.. of `slot`): the same picks from the
    same uniforms."""
    picks, qs = [], []
    for j in range(k):
        index, q = pick(logits, temperature, None if uniforms is None else float(uniforms[j]))
        picks.append(index)
        qs.append(q)
        if j == k - 1:
            break
        batch = RaggedBatch.build([slot], [position + j], [1])
        logits, feature = head.forward_ragged(embed(head.vocab[index:index + 1]), feature[None], batch, cache,
                                              torch.zeros(1, dtype=torch.long))
        logits, feature = logits[0], feature[0]
    return torch.tensor(picks), None if uniforms is None else torch.stack(qs)


def pick(logits: torch.Tensor, temperature: float, u: float | None) -> tuple[int, torch.Tensor | None]:
    """logits [Vd] -> (index, q [Vd] or None): the first maximum at temperature 0, else the inverse-CDF
    draw of u from softmax(logits / T) (the first index whose cumulative mass exceeds u)."""
    if temperature == 0:
        return int(logits.argmax()), None
    q = (logits.float() / temperature).softmax(-1)
    cumulative = q.cumsum(-1)
    index = int(torch.searchsorted(cumulative, torch.tensor([u]), right=True))
    if index >= q.shape[0]:  # rounding left u above the total: the last index with mass
        index = int(q.nonzero()[-1])
    return index, q
