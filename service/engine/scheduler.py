"""Continuous batching: one scheduler thread owns the models and runs every request in flight.

Contract:
- Callers `submit` a Sequence and block until it is done; the scheduler thread is the only one that
  runs the models. Up to `max_batch` sequences run at once, each in its own KV-cache slot; more wait.
- One scheduler step = draft for every running sequence (its own policy, spec/drafting.py), then ONE
  target pass over all their windows `[last committed token, drafts...]` back to back (ragged),
  then per-sequence acceptance with the sequence's own sampling and generator (`accept`,
  `accept_greedy_ids`, ... looked up in this module, imported from `service.engine.spec.sampling`),
  commit, stop rules and streaming.
- Sequences join and leave between steps. Chunked prefill: each scheduler iteration runs at most
  one prefill pass of at most `prefill_chunk` prompt tokens over the newcomers (first come, first
  served; a longer prompt continues in the next iterations), then the step of the running
  sequences, newcomers whose prompt is now all in included; so a long prompt never stalls them for
  more than one bounded pass per token. With nobody decoding, one pass prefills every waiting prompt
  whole. Prompt chunks run in a pass of their own rather than beside the decode windows: when
  attention was one padded call per pass, a long prompt chunk beside short decode windows padded
  every window to the chunk's length and cost more than the two passes (docs/engine.md, "Chunked
  prefill"). A sequence whose `should_stop()` is true (cancel, deadline) leaves before the next
  pass, with what it has; `should_stop` is polled once per scheduler iteration the sequence is in
  (prefill included: a cancelled request stops prefilling too).
- Per-step work that does not need a request's own generator runs once per pass: one argmax over
  every row for the greedy requests, the per-request and batch unions in one scatter, one
  `target_probs` per sampling setting over its sampled requests' rows; each sampled request keeps its
  own `accept` call (their random streams must not interleave).
- Every step yields one StepRecord per sequence and one BatchPassRecord for the pass, attached to
  those StepRecords (step_records.py). Draft and verify seconds of a step are the pass's. Every
  pass takes a pass id, prefill passes too.
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

import torch

from service.engine import step_records
from service.engine.model.ragged import RaggedBatch
from service.engine.sequence import Sequence
from service.engine.spec.adaptive.controller import StepOutcome, adapts
from service.engine.spec.drafting import Proposal, draft, uses_head
from service.engine.spec.sampling import accept, accept_greedy_ids, target_probs
from service.types import Drafter, FinishReason, GenerationResult

if TYPE_CHECKING:
    from service.engine.engine import Engine

logger = logging.getLogger(__name__)


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
        # Requests finished in the last step: their callers' threads build the results and submit the
        # next requests beside the coming pass (what the adaptive estimates must not take for its cost).
        self._finished_last = False
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
            else:
                (self._prefilling if seq.prefill_left > 0 else self._running).append(seq)

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
        self._prefill_dense_draft(chunks)
        next(self._pass_ids)  # prefill passes are numbered too: a gap in a request's pass ids is a pass it waited
        for chunk in chunks:
            chunk.seq.prefilled += chunk.length
            if chunk.completes:  # decodes from this iteration's step on
                self._prefilling.remove(chunk.seq)
                self._running.append(chunk.seq)

    def _prefill_dense_draft(self, chunks: list[PrefillChunk]) -> None:
        """A dense draft model's cache takes the prompt chunks of the sequences that draft with it in the
        same prefill pass: their first step then drafts at once instead of catching up on the whole
        prompt (prefill work, timed as prefill, as llama.cpp's speculative decoding times it)."""
        e = self.e
        if e.draft is None or e.draft_is_head:
            return
        dense = [c for c in chunks if uses_head(c.seq) and c.seq.draft_valid == c.start]
        if not dense:
            return
        tokens = torch.tensor([t for c in dense for t in c.tokens()])
        batch = RaggedBatch.build([c.seq.slot for c in dense], [c.start for c in dense], [c.length for c in dense])
        e.draft.fill_cache(tokens, batch, e.draft_cache)
        for chunk in dense:
            chunk.seq.draft_valid = chunk.start + chunk.length

    def _step(self, seqs: list[Sequence], prefilled: int) -> None:
        """One target pass over the verify windows of `seqs`; `prefilled` prompt tokens ran just before."""
        e = self.e
        start_ns, t0 = time.time_ns(), time.perf_counter()
        for seq in seqs:  # each runs its policy's (its table's cell's) controller at this occupancy
            seq.enter_step(len(seqs), e.adaptive.controller_for)
        proposals = draft(e, seqs)  # per sequence: its drafts, q [k', V] or None, draft seconds, confidences
        t1 = time.perf_counter()
        windows = [[s.ids[-1], *p.drafts] for s, p in zip(seqs, proposals, strict=True)]  # [w_b]
        lengths = [len(w) for w in windows]
        batch = RaggedBatch.build([s.slot for s in seqs], [len(s.ids) - 1 for s in seqs], lengths)
        out = e.target.forward_ragged(torch.tensor([t for w in windows for t in w]), batch, e.target_cache)
        pass_id = next(self._pass_ids)
        logits, routed = out.logits, out.routed_ids  # [n, V], [L, n, m]
        if e.draft_is_head and any(uses_head(s) for s in seqs):  # what the head's next catch-up reads
            e.target_features[batch.token_slot, batch.positions] = out.features
        verdicts, sampling_seconds, sampled_rows = self._accept(seqs, proposals, logits, lengths)
        t2 = time.perf_counter()
        if len(seqs) == 1 and lengths[0] == 1:
            e.observe_plain_step(t2 - t1)
        own_unique, batch_unique = step_records.unions(e, routed, lengths)
        own_overlap = step_records.overlaps(e, routed, lengths)
        pass_record = step_records.pass_record(e, pass_id, lengths, routed, batch_unique, prefilled, start_ns,
                                               t1 - t0, t2 - t1)
        step_unit = e.current_decode_step_seconds()
        # Each window's routed ids, only where a record keeps them (top-k capture, the EP estimate): a
        # batched step does this loop for every request, so it does nothing a request does not need.
        window_ids = routed.split(lengths, dim=1) if step_records.records_ids(e) else [None] * len(seqs)
        adaptive = self._observe_controllers(seqs, proposals, verdicts, lengths, t0, t2)
        finished = []
        for seq, proposal, window, ids, unique, overlap, (n_ok, _, bonus) in zip(
                seqs, proposals, windows, window_ids, own_unique, own_overlap, verdicts, strict=True):
            drafts, draft_s = proposal.drafts, proposal.seconds
            k = len(drafts)
            if seq.step_policy.drafter is Drafter.MODEL and k > 0:
                # The draft cache holds the old tokens plus drafts 1..k-1. A dense draft's entries of
                # accepted drafts stay valid; a head's read its own feature estimates, so they are redone.
                seq.draft_valid = len(seq.ids) + (0 if e.draft_is_head else min(n_ok, k - 1))
            record = step_records.step_record(e, seq, k, n_ok, window, ids, unique, draft_s, t2 - t1, step_unit,
                                              pass_record, proposal.planned, overlap)
            try:
                finish = seq.commit([*drafts[:n_ok], bonus], record, e.eos_id, e.decode)
            except Exception as error:  # e.g. the caller's on_delta raised: only this request fails
                self._release(seq)
                seq.fail(error)
                continue
            if finish is not None:
                finished.append((seq, finish))
        if adaptive:
            # The engine's estimates learn what the step paid after drafting: the pass, the acceptance,
            # the unions, records and commits (a longer window pays for all of them), not the finishing
            # of requests, which every request pays once whatever its windows.
            union = sum(batch_unique) / len(batch_unique) if batch_unique else 0.0
            e.adaptive.observe_pass(sum(lengths), union, time.perf_counter() - t1, sampling_seconds, sampled_rows,
                                    plain=max(lengths) == 1, disturbed=prefilled > 0 or self._finished_last)
        for seq, finish in finished:
            self._finish(seq, finish)
        self._finished_last = bool(finished)

    def _observe_controllers(self, seqs: list[Sequence], proposals: list[Proposal], verdicts: list,
                             lengths: list[int], t0: float, t2: float) -> bool:
        """Each controller hears its request's outcome -> whether any request adapts (then the
        engine's estimates learn from the step; a pass of static policies pays nothing for them)."""
        adaptive = any(adapts(s.controller) for s in seqs)
        shared = []  # the controllers a policy's requests share: each hears the pass's end once
        for seq, proposal, (n_ok, _, _), w in zip(seqs, proposals, verdicts, lengths, strict=True):
            controller = seq.controller
            if adaptive and (w > 1 or proposal.planned > 0 or controller.hears_plain_steps):
                controller.observe(StepOutcome(w - 1, n_ok, t2 - t0, n_ok + 1, proposal.confidence, proposal.planned))
            if controller.shared:
                shared.append(controller)
            seq.last_window = w
        if shared:
            self.e.adaptive.end_pass(shared, len(seqs))
        return adaptive

    def _accept(self, seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
                lengths: list[int]) -> tuple[list[tuple[int, tuple[bool, ...], int]], float, int]:
        """Per sequence: (drafts accepted, accepted flags [k], the target's next token); and the
        seconds and rows of the sampled sequences' acceptance (what one more sampled row costs
        beyond the pass: the adaptive controllers price it).

        Greedy sequences (p a point mass: acceptance is an exact prefix match) share one argmax over
        every row of the pass; sampled ones share their target distributions (`_sampled_probs`) and
        each draws from its own generator.
        """
        greedy = any(s.request.sampling.greedy for s in seqs)
        # [n]: every row at once; numpy's argmax (first maximum, like torch's) is ~10x cheaper on 16 x 4096
        argmax = logits.numpy().argmax(-1).tolist() if greedy else []
        started = time.perf_counter()
        probs = _sampled_probs(seqs, logits, lengths)
        sampling_seconds = time.perf_counter() - started  # (the greedy verdicts below are not sampling's)
        verdicts, offset, sampled_rows = [], 0, 0
        for seq, proposal, w, p in zip(seqs, proposals, lengths, probs, strict=True):
            drafts, q = proposal.drafts, proposal.q
            if p is None:
                verdicts.append(accept_greedy_ids(drafts, argmax[offset:offset + w]))
            else:
                started = time.perf_counter()
                n_ok, ok, bonus = accept(torch.tensor(drafts, dtype=torch.long), q if q is not None else p[:0], p,
                                         seq.gen)
                verdicts.append((n_ok, tuple(ok.tolist()), int(bonus)))
                sampling_seconds += time.perf_counter() - started
                sampled_rows += w
            offset += w
        return verdicts, sampling_seconds, sampled_rows


def _sampled_probs(seqs: list[Sequence], logits: torch.Tensor, lengths: list[int]) -> list[torch.Tensor | None]:
    """Each sampled sequence's target distributions p [w, V] over its window's rows (None for a
    greedy one). The rows of every sequence with the same temperature, top-p and top-k go through
    one `target_probs` call: its operations are row by row, so each row's p is bitwise what it is
    alone, and a pass of 8 sampled requests pays ~230 us for them instead of ~390 (each call is a
    dozen small operations whose fixed cost exceeded their work on one 4,096-token row)."""
    offsets = [0, *itertools.accumulate(lengths)]
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i, seq in enumerate(seqs):
        params = seq.request.sampling
        if not params.greedy:
            groups.setdefault((params.temperature, params.top_p, params.top_k), []).append(i)
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for members in groups.values():
        rows = torch.cat([logits[offsets[i]:offsets[i + 1]] for i in members])
        p = target_probs(rows, seqs[members[0]].request.sampling)  # [rows, V]
        for i, part in zip(members, p.split([lengths[i] for i in members]), strict=True):
            probs[i] = part
    return probs
