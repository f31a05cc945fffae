"""The EAGLE-3 draft's rounds for one scheduler step (model/eagle3.py), batched over its sequences.

Entry p of a sequence's draft cache sits at position p and reads (the target's aux at p, token
p + 1), as in SGLang: a sequence of n tokens has true entries 0..n-2 (the target has run positions
0..n-2; token n-1 opens the verify window). `Sequence.draft_valid` counts the true entries the
cache holds; the catch-up feeds the rest in one ragged pass over every sequence, its last entry
drafts the first token, and each chain entry (position n-1, n, ...) reads the previous entry's
output hidden and the token just drafted. After verification the scheduler sets draft_valid to
the committed tokens' true entries, so the chain entries of rejected (and accepted) drafts are
recomputed from the target's aux and overwritten: nothing a rejected draft wrote is read again.

Returns what model_drafting's drafters return: per sequence the drafts (target ids) [k], q [k, V]
(a point mass for a greedy chain; over the target's vocabulary, zero outside the draft
vocabulary, for a sampled one) and its confidences where asked.
"""

from __future__ import annotations

import torch

from service.engine.model.eagle3 import Eagle3Draft
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.model_drafting import Drafted, draft_confidence, pick
from service.engine.spec.sampling import point_mass


def draft_with_eagle3(rt: Runtime, seqs: list[Sequence], ks: list[int], confident: list[bool]) -> list[Drafted]:
    draft, vocab_size = rt.draft, rt.target.cfg.vocab_size
    out: list[Drafted] = [(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab_size), None) for _ in seqs]
    caught_up = catch_up(rt, seqs)
    target_ids = draft.target_ids
    for b, root in caught_up.items():
        s, temperature = seqs[b], seqs[b].step_policy.draft_temperature
        uniforms = torch.rand(ks[b], generator=s.gen) if temperature > 0 else None
        with torch.no_grad():
            picks, q = chain(draft, rt.target.embed_tokens, rt.draft_cache, s.slot, len(s.ids) - 1, ks[b],
                             *root, temperature, uniforms, target_ids)
        drafts = target_ids[picks]
        if q is None:
            out[b] = (drafts, point_mass(drafts, vocab_size), None)
        else:
            out[b] = (drafts, torch.zeros(q.shape[0], vocab_size).index_copy_(1, target_ids, q),
                      draft_confidence(q, picks) if confident[b] else None)
    return out


def catch_up(rt: Runtime, seqs: list[Sequence]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One ragged pass feeding every sequence's missing true entries -> {index in seqs: (the draft
    logits [Vd] and output hidden [H] of its last entry, at the last committed token)}; a sequence of one
    token (no entry yet) is left out."""
    draft = rt.draft
    rows = [b for b, s in enumerate(seqs) if len(s.ids) - 1 > s.draft_valid]  # a one-token prompt has no entry yet
    if not rows:
        return {}
    tokens, aux, lengths = [], [], []
    for b in rows:
        s = seqs[b]
        tokens.append(torch.tensor(s.ids[s.draft_valid + 1:], dtype=torch.long))  # token p + 1 of entry p
        aux.append(rt.target_features[s.slot, s.draft_valid:len(s.ids) - 1])  # aux at p
        lengths.append(tokens[-1].shape[0])
    batch = RaggedBatch.build([seqs[b].slot for b in rows], [seqs[b].draft_valid for b in rows], lengths)
    with torch.no_grad():
        logits, hidden = draft.forward_ragged(rt.target.embed_tokens(torch.cat(tokens)),
                                              draft.project_aux(torch.cat(aux)), batch, rt.draft_cache,
                                              torch.tensor(lengths).cumsum(0) - 1)  # [B', Vd], [B', H]
    return {b: (logits[j], hidden[j]) for j, b in enumerate(rows)}


def chain(draft: Eagle3Draft, embed: torch.nn.Embedding, cache: KVCache, slot: int, position: int, k: int,
          logits: torch.Tensor, hidden: torch.Tensor, temperature: float, uniforms: torch.Tensor | None,
          target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After the catch-up, whose last entry gave logits [Vd] and its output hidden [H]: k draft
    indices (and their q [k, Vd] when sampled). Chain entry j sits at `position` + j of `slot`."""
    picks, qs = [], []
    for j in range(k):
        index, q = pick(logits, temperature, None if uniforms is None else float(uniforms[j]))
        picks.append(index)
        qs.append(q)
        if j == k - 1:
            break
        batch = RaggedBatch.build([slot], [position + j], [1])
        logits, hidden = draft.forward_ragged(embed(target_ids[index:index + 1]), hidden[None], batch, cache,
                                              torch.zeros(1, dtype=torch.long))
        logits, hidden = logits[0], hidden[0]
    return torch.tensor(picks, dtype=torch.long), None if uniforms is None else torch.stack(qs)
