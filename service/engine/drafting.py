"""Each running sequence's proposal for one scheduler step, under its own draft policy.

An n-gram sequence looks its drafts up in its own tokens (ngram.py; q is a point mass on each
draft); the sequences that draft with the model run together, batched, in the model drafter's
rounds (model_drafting.py: the dense draft model or the draft head). Apart from the scheduler's
loop: the loop decides which sequences run a step; this decides what each of them proposes.

Shape legend: k' drafts proposed, V vocabulary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from service.engine import model_drafting, ngram
from service.engine.sampling import point_mass
from service.engine.sequence import Sequence
from service.types import Drafter

if TYPE_CHECKING:
    from service.engine.engine import Engine


def uses_head(seq: Sequence) -> bool:
    """The sequence drafts with the model drafter (a draft head, where the engine has one)."""
    return seq.policy.drafter is Drafter.MODEL and seq.policy.draft_length > 0


def draft(e: Engine, seqs: list[Sequence]) -> list[tuple[list[int], torch.Tensor | None, float]]:
    """Each sequence's proposal (drafts, q [k', V] or None, seconds) under its own policy; the
    draft model runs batched over them."""
    cfg, vocab = e.config, e.info.vocab_size
    out: list[tuple[list[int], torch.Tensor | None, float]] = []
    model_rows: list[tuple[int, int]] = []  # (index in seqs, k)
    for i, seq in enumerate(seqs):
        k = seq.draft_budget()
        t0 = time.perf_counter()
        if k > 0 and seq.policy.drafter is Drafter.NGRAM:
            drafts = ngram.propose(seq.tokens, k, cfg.ngram_min, cfg.ngram_max)
            out.append((drafts.tolist(), point_mass(drafts, vocab), time.perf_counter() - t0))
        else:
            out.append(([], None, 0.0))
            if k > 0:
                model_rows.append((i, k))
    if model_rows:
        t0 = time.perf_counter()
        draft_rounds = model_drafting.draft_with_head if e.draft_is_head else model_drafting.draft_dense
        drafted = draft_rounds(e, [seqs[i] for i, _ in model_rows], [k for _, k in model_rows])
        seconds = time.perf_counter() - t0
        for (i, _), (drafts, q) in zip(model_rows, drafted, strict=True):
            out[i] = (drafts.tolist(), q, seconds)
    return out
