"""Continuous batching: one scheduler thread owns the models and runs every request in flight.

Contract:
- Callers `submit` a Sequence and block until it is done; the scheduler thread is the only one that
  runs the models. Up to `max_batch` sequences run at once, each in its own KV-cache slot; more wait.
- One scheduler step = draft for every running sequence (its own policy: n-gram lookups per
  sequence, the draft model in batched ragged passes), then ONE target pass over all their windows
  `[last committed token, drafts...]` back to back (ragged), then per-sequence acceptance with the
  sequence's own sampling and generator (`accept`, `accept_greedy_ids`, ... looked up in this module,
  imported from `service.engine.sampling`), commit, stop rules and streaming.
- Sequences join and leave between steps. Chunked prefill: each scheduler iteration runs at most
  one prefill pass of at most `prefill_chunk` prompt tokens over the newcomers (first come, first
  served; a longer prompt continues in the next iterations), then the step of the running
  sequences, newcomers whose prompt is now all in included; so a long prompt never stalls them for
  more than one bounded pass per token. With nobody decoding, one pass prefills every waiting prompt
  whole. (Prompt chunks run in a pass of their own rather than beside the decode windows: when
  attention was one padded call per pass, a long chunk beside 16 one-token windows cost more than
  the two passes, measured; not re-measured with the fused attention kernel; see the README.)
  A sequence whose `should_stop()` is true (cancel, deadline) leaves before the next pass, with what
  it has; `should_stop` is polled once per scheduler iteration the sequence is in (prefill included:
  a cancelled request stops prefilling too).
- Per-step work that does not need a request's own generator runs once per pass: one argmax over
  every row for the greedy requests, the per-request and batch unions in one scatter; sampled
  requests keep their own `target_probs` / `accept` calls (their random streams must not interleave).
- Every step yields one StepRecord per sequence (its own window's union) and one BatchPassRecord
  for the pass (the union over every position of every window; `prefill_tokens`: the prompt tokens
  of the prefill pass that ran just before it, what its requests waited for), attached to those
  StepRecords. Draft and verify seconds of a step are the pass's. Every pass takes a pass id,
  prefill passes too.
- A fault while running a pass fails the sequences in it (their callers get the exception); the
  scheduler keeps serving the others and newcomers.

Shape legend: B sequences in a pass, N tokens in it, w a window, L layers, m experts per token, V vocab.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from service import expert_parallel
from service.engine import model_drafting, ngram
from service.engine.ragged import RaggedBatch
from service.engine.sampling import accept, accept_greedy_ids, point_mass, target_probs
from service.engine.sequence import Sequence
from service.types import BatchPassRecord, Drafter, FinishReason, GenerationResult, StepRecord, accepted_positions

if TYPE_CHECKING:
    from service.engine.engine import Engine

logger = logging.getLogger(__name__)


def unique_experts_per_layer(routed: torch.Tensor, num_experts: int) -> tuple[int, ...]:
    """routed ids [L, w, m] -> distinct experts per layer: mark every expert any position picked."""
    L = routed.shape[0]
    touched = np.zeros((L, num_experts), dtype=bool)
    np.put_along_axis(touched, routed.numpy().reshape(L, -1), True, axis=1)  # [L, E]
    return tuple(touched.sum(-1).tolist())


def unique_experts_per_window(routed: torch.Tensor, lengths: list[int], num_experts: int
                              ) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """routed ids [L, N, m] of B windows back to back -> (each window's distinct experts per layer,
    the whole pass's), in one scatter: `unique_experts_per_layer` of every window and of the pass.
    (numpy: on arrays this small each torch op costs several times more.)"""
    L, N, m = routed.shape
    B = len(lengths)
    window = np.repeat(np.arange(B), lengths)  # [N] window of each position
    flat = (window[None, :, None] * num_experts + routed.numpy()).reshape(L, N * m)  # [L, N*m] into [B*E]
    touched = np.zeros((L, B * num_experts), dtype=bool)
    np.put_along_axis(touched, flat, True, axis=1)
    touched = touched.reshape(L, B, num_experts)
    own = touched.sum(-1).T.tolist()  # [B, L]
    return [tuple(c) for c in own], tuple(touched.any(1).sum(-1).tolist())


def uses_head(seq: Sequence) -> bool:
    """The sequence drafts with the model drafter (a draft head, where the engine has one)."""
    return seq.policy.drafter is Drafter.MODEL and seq.policy.draft_length > 0


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start+length) of a sequence, riding in one pass."""

    seq: Sequence
    start: int
    length: int
    completes: bool  # the prompt's last chunk

    def tokens(self) -> list[int]:
        return self.seq.ids[self.start:self.start + self.length]


class EngineClosed(RuntimeError):
    """The engine was closed while the request waited or ran."""


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int, prefill_chunk: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        # Weak: the scheduler thread must not keep its engine alive (the engine's finalizer stops it).
        self._engine = weakref.ref(engine)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk  # prompt tokens per pass, over every sequence still prefilling
        self._cv = threading.Condition()  # guards _waiting, _free_slots, _closed
        self._waiting: deque[Sequence] = deque()
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out slot 0 first
        self._closed = False
        self._running: list[Sequence] = []  # scheduler thread only: decoding
        self._prefilling: deque[Sequence] = deque()  # scheduler thread only: admitted, prompt not all in cache
        self._pass_ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="moespec-scheduler", daemon=True)
        self._thread.start()

    @property
    def e(self) -> Engine:
        engine = self._engine()
        if engine is None:
            raise EngineClosed("the engine is gone")
        return engine

    def submit(self, seq: Sequence) -> GenerationResult:
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._waiting.append(seq)
            self._cv.notify()
        seq.done.wait()
        if seq.error is not None:
            raise seq.error
        return seq.result

    def close(self) -> None:
        """Running and waiting requests end CANCELLED with what they have; then the thread exits."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:  # (the engine's finalizer may run anywhere)
            self._thread.join()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._waiting or self._running or self._prefilling or self._closed):
                        self._cv.wait()
                    if self._closed:
                        leaving = self._running + list(self._prefilling) + list(self._waiting)
                        self._waiting.clear()
                        break
                    joining = []
                    while self._waiting and self._free_slots:
                        seq = self._waiting.popleft()
                        seq.slot = self._free_slots.pop()
                        joining.append(seq)
                self._join(joining)
                self._leave_stopped(skip=joining)
                chunks, prefilled = self._plan_prefill(), 0
                if chunks:
                    self._run_guarded(self._prefill, [c.seq for c in chunks], chunks)
                    prefilled = sum(c.length for c in chunks)
                if self._running:  # (a newcomer whose prompt is now all in takes its first step here)
                    self._run_guarded(self._step, list(self._running), prefilled)
        for seq in leaving:
            self._finish(seq, FinishReason.CANCELLED)

    def _run_guarded(self, work, seqs: list[Sequence], *args) -> None:
        try:
            work(seqs, *args)
        except Exception as error:  # a fault in a pass: its sequences fail, the others keep running
            logger.exception("engine pass failed for %d request(s)", len(seqs))
            for seq in seqs:
                if not seq.done.is_set():
                    self._release(seq)
                    seq.fail(error)

    def _join(self, joining: list[Sequence]) -> None:
        """Admit newcomers: a stopped one leaves at once; the rest queue for prefill (a one-token
        prompt has nothing to prefill and decodes at once)."""
        for seq in joining:
            if self._stopped(seq):  # its deadline passed, or its caller left, while it waited
                if not seq.done.is_set():
                    self._finish(seq, FinishReason.CANCELLED)
            elif seq.prefill_left > 0:
                self._prefilling.append(seq)
            else:
                self._running.append(seq)

    def _plan_prefill(self) -> list[PrefillChunk]:
        """This pass's prompt chunks: first come, first served, `prefill_chunk` tokens in all while
        anyone decodes; with nobody decoding there is no one to stall, so every waiting prompt goes
        in whole."""
        chunks, budget = [], self.prefill_chunk if self._running else sum(s.prefill_left for s in self._prefilling)
        for seq in self._prefilling:
            if budget == 0:
                break
            length = min(budget, seq.prefill_left)
            chunks.append(PrefillChunk(seq, seq.prefilled, length, completes=length == seq.prefill_left))
            budget -= length
        return chunks

    def _leave_stopped(self, skip: list[Sequence]) -> None:
        # A newcomer was asked at admission; asking again would poll it twice before its first step.
        in_flight = self._running + list(self._prefilling)
        for seq in [s for s in in_flight if s not in skip and self._stopped(s)]:
            if not seq.done.is_set():
                self._finish(seq, FinishReason.CANCELLED)

    def _stopped(self, seq: Sequence) -> bool:
        """The caller's should_stop(); if it raises, that request fails alone (the caller gets the error)."""
        try:
            return seq.should_stop()
        except Exception as error:
            self._release(seq)
            seq.fail(error)
            return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release(seq)
        try:
            seq.finish(reason, self.e.decode, self.e.target.cfg.num_hidden_layers)
        except Exception as error:  # never leave a caller waiting
            seq.fail(error)

    def _release(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if seq.slot >= 0:
            with self._cv:
                self._free_slots.append(seq.slot)
            seq.slot = -1

    # ------------------------------------------------------------------ one step
    def _prefill(self, seqs: list[Sequence], chunks: list[PrefillChunk]) -> None:
        """One target pass over prompt chunks (no verify windows): their keys/values go to the cache."""
        tokens = torch.tensor([t for c in chunks for t in c.tokens()])
        batch = RaggedBatch.build([c.seq.slot for c in chunks], [c.start for c in chunks], [c.length for c in chunks])
        e = self.e
        # A draft head reads the target's features of the prompt too (one more MLP per pass).
        head_users = e.draft_is_head and any(uses_head(c.seq) for c in chunks)
        features = e.target.fill_cache(tokens, batch, e.target_cache, features=head_users)
        if features is not None:
            e.target_features[batch.token_slot, batch.positions] = features
        next(self._pass_ids)  # prefill passes are numbered too: a gap in a request's pass ids is a pass it waited
        for chunk in chunks:
            chunk.seq.prefilled += chunk.length
            if chunk.completes:  # decodes from this iteration's step on
                self._prefilling.remove(chunk.seq)
                self._running.append(chunk.seq)

    def _step(self, seqs: list[Sequence], prefilled: int) -> None:
        """One target pass over the verify windows of `seqs`; `prefilled` prompt tokens ran just before."""
        e = self.e
        start_ns, t0 = time.time_ns(), time.perf_counter()
        proposals = self._draft(seqs)  # per sequence: (drafts, q [k', V] or None, draft seconds)
        t1 = time.perf_counter()
        windows = [[s.ids[-1], *drafts] for s, (drafts, _, _) in zip(seqs, proposals, strict=True)]  # [w_b]
        lengths = [len(w) for w in windows]
        batch = RaggedBatch.build([s.slot for s in seqs], [len(s.ids) - 1 for s in seqs], lengths)
        out = e.target.forward_ragged(torch.tensor([t for w in windows for t in w]), batch, e.target_cache)
        pass_id = next(self._pass_ids)
        logits, routed = out.logits, out.routed_ids  # [n, V], [L, n, m]
        if e.draft_is_head and any(uses_head(s) for s in seqs):  # what the head's next catch-up reads
            e.target_features[batch.token_slot, batch.positions] = out.features
        verdicts = self._accept(seqs, proposals, logits, lengths)
        t2 = time.perf_counter()
        if len(seqs) == 1 and lengths[0] == 1:
            e.observe_plain_step(t2 - t1)
        own_unique, batch_unique = self._unions(routed, lengths)
        pass_record = self._pass_record(pass_id, lengths, routed, batch_unique, prefilled, start_ns, t1 - t0, t2 - t1)
        step_unit = e.current_decode_step_seconds()
        # Each window's routed ids, only where a record keeps them (top-k capture, the EP estimate): a
        # batched step does this loop for every request, so it does nothing a request does not need.
        window_ids = routed.split(lengths, dim=1) if self._records_ids() else [None] * len(seqs)
        for seq, (drafts, _, draft_s), window, ids, unique, (n_ok, _, bonus) in zip(
                seqs, proposals, windows, window_ids, own_unique, verdicts, strict=True):
            k = len(drafts)
            if seq.policy.drafter is Drafter.MODEL and k > 0:
                # The draft cache holds the old tokens plus drafts 1..k-1. A dense draft's entries of
                # accepted drafts stay valid; a head's read its own feature estimates, so they are redone.
                seq.draft_valid = len(seq.ids) + (0 if e.draft_is_head else min(n_ok, k - 1))
            record = self._record(seq, k, n_ok, window, ids, unique, draft_s, t2 - t1, step_unit, pass_record)
            try:
                finish = seq.commit([*drafts[:n_ok], bonus], record, e.eos_id, e.decode)
            except Exception as error:  # e.g. the caller's on_delta raised: only this request fails
                self._release(seq)
                seq.fail(error)
                continue
            if finish is not None:
                self._finish(seq, finish)

    def _accept(self, seqs: list[Sequence], proposals: list, logits: torch.Tensor,
                lengths: list[int]) -> list[tuple[int, tuple[bool, ...], int]]:
        """Per sequence: (drafts accepted, accepted flags [k], the target's next token).

        Greedy sequences (p a point mass: acceptance is an exact prefix match) share one argmax over
        every row of the pass; sampled ones draw from their own generator, one at a time.
        """
        greedy = any(s.request.sampling.greedy for s in seqs)
        # [n]: every row at once; numpy's argmax (first maximum, like torch's) is ~10x cheaper on 16 x 4096
        argmax = logits.numpy().argmax(-1).tolist() if greedy else []
        verdicts, offset = [], 0
        for seq, (drafts, q, _), w in zip(seqs, proposals, lengths, strict=True):
            if seq.request.sampling.greedy:
                verdicts.append(accept_greedy_ids(drafts, argmax[offset:offset + w]))
            else:
                p = target_probs(logits[offset:offset + w], seq.request.sampling)  # [w, V]
                n_ok, ok, bonus = accept(torch.tensor(drafts, dtype=torch.long), q if q is not None else p[:0], p,
                                         seq.gen)
                verdicts.append((n_ok, tuple(ok.tolist()), int(bonus)))
            offset += w
        return verdicts

    def _unions(self, routed: torch.Tensor, lengths: list[int]) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        """Each window's distinct experts per layer and the pass's (zeros when routing is not counted)."""
        if not self.e.config.capture_routing:
            zeros = (0,) * routed.shape[0]
            return [zeros] * len(lengths), zeros
        if len(lengths) == 1:  # a request alone: its window is the pass (one scatter, fewer ops)
            unique = unique_experts_per_layer(routed, self.e.target.cfg.num_experts)
            return [unique], unique
        return unique_experts_per_window(routed, lengths, self.e.target.cfg.num_experts)

    # ------------------------------------------------------------------ drafting
    def _draft(self, seqs: list[Sequence]) -> list[tuple[list[int], torch.Tensor | None, float]]:
        """Each sequence's proposal (drafts, q [k', V] or None, seconds) under its own policy; the
        draft model runs batched over them."""
        cfg, vocab = self.e.config, self.e.info.vocab_size
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
            draft_rounds = model_drafting.draft_with_head if self.e.draft_is_head else model_drafting.draft_dense
            drafted = draft_rounds(self.e, [seqs[i] for i, _ in model_rows], [k for _, k in model_rows])
            seconds = time.perf_counter() - t0
            for (i, _), (drafts, q) in zip(model_rows, drafted, strict=True):
                out[i] = (drafts.tolist(), q, seconds)
        return out

    # ------------------------------------------------------------------ records
    def _pass_record(self, pass_id: int, lengths: list[int], routed: torch.Tensor, unique: tuple[int, ...],
                     prefill_tokens: int, start_ns: int, draft_s: float, verify_s: float) -> BatchPassRecord:
        cfg = self.e.target.cfg
        E, m = cfg.num_experts, cfg.num_experts_per_tok
        N = sum(lengths)
        ep = {} if self.e.ep is None else expert_parallel.pass_fields(self.e.ep, routed, self.e.ep_token_bytes)
        return BatchPassRecord(pass_id=pass_id, batch_size=len(lengths), positions=N,
                               windows=tuple(lengths), unique_experts=unique, unique_experts_bound=min(E, N * m),
                               draft_seconds=draft_s, verify_seconds=verify_s, start_time_ns=start_ns,
                               prefill_tokens=prefill_tokens, **ep)

    def _captures_topk(self) -> bool:
        """Step records keep each window's routed ids (`capture_topk`, or a step recording)."""
        return self.e.config.capture_topk or self.e.recorder is not None

    def _records_ids(self) -> bool:
        """Step records need each window's routed ids: captured top-k ids, or an EP estimate."""
        return self._captures_topk() or self.e.ep is not None

    def _record(self, seq: Sequence, drafted: int, accepted: int, window: list[int],
                routed: torch.Tensor | None, unique: tuple[int, ...], draft_s: float, verify_s: float,
                step_unit: float, batch: BatchPassRecord) -> StepRecord:
        """routed: the window's ids [L, w, m] (None unless `_records_ids`)."""
        e, policy = self.e, seq.policy
        cfg, capture = e.target.cfg, self._captures_topk()
        E, m = cfg.num_experts, cfg.num_experts_per_tok
        ep = {}  # the optional expert-parallel fields, estimated only with an EP size
        if e.ep is not None:
            ep = expert_parallel.pass_fields(e.ep, routed, e.ep_token_bytes)
        return StepRecord.of_policy(
            policy,
            drafted=drafted,
            accepted=accepted,
            committed=accepted + 1,
            accepted_per_position=accepted_positions(drafted, accepted),
            window=len(window),
            unique_experts=unique,
            shared_experts=1,
            num_experts=E,
            top_k=m,
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            decode_step_equivalents=verify_s / step_unit,
            topk_ids=tuple(tuple(tuple(pos) for pos in layer) for layer in routed.tolist()) if capture else None,
            window_ids=tuple(window) if capture else None,
            batch=batch,
            **ep,
        )
