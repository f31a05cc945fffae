"""Continuous batching: one scheduler thread decides what runs, for every request in flight.

Contract:
- Callers `submit` a Sequence and block until it is done; the scheduler thread is the only one that
  runs the models. Up to `max_batch` sequences run at once, each in its own KV-cache slot; more wait.
- Each iteration: schedule (admit newcomers, drop stopped ones, plan the prefill chunks), execute
  (the model runner, model_runner.py: a prefill pass, then one verify pass over the running
  sequences: drafting, ONE target pass over every window, each window's verdict with the sequence's
  own sampling and generator, spec/acceptance.py), update from its output (records, controllers,
  commit, stop rules and streaming, finished requests out).
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
- Several steps in one kernel call (`_steps_in_one_call`, up to `steps_per_call`): greedy plain steps of
  the whole batch, or a lone request's greedy draft-head chain, when nothing needs Python between the
  steps and nobody waits to join; each step is then updated as if it had run alone (its records, commit
  and streaming), and stops are polled between calls rather than between steps.
- Per-step work that does not need a request's own generator runs once per pass: the verdicts
  (spec/acceptance.py), the per-request and batch unions in one scatter (step_records.py).
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
from collections import deque

import torch

from service.engine.model_runner import ModelRunner, PrefillChunk, VerifyOutput
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.adaptive.controller import StepOutcome, adapts
from service.types import Drafter, FinishReason, GenerationResult

logger = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """The engine was closed while the request waited or ran."""


class Scheduler:
    def __init__(self, runtime: Runtime, max_batch: int, prefill_chunk: int, steps_per_call: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        # The runtime, not the engine: the scheduler thread must not keep its engine alive (the
        # engine's finalizer stops it).
        self.rt = runtime
        self.runner = ModelRunner(runtime)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk  # prompt tokens per pass, over every sequence still prefilling
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        self.steps_per_call = steps_per_call  # greedy steps one kernel call may run back to back
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
            seq.finish(reason, self.rt.decode, self.rt.num_layers)
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

    # ------------------------------------------------------------------ execute, then update
    def _prefill(self, seqs: list[Sequence], chunks: list[PrefillChunk]) -> None:
        self.runner.prefill(chunks)
        next(self._pass_ids)  # prefill passes are numbered too: a gap in a request's pass ids is a pass it waited
        for chunk in chunks:
            chunk.seq.prefilled += chunk.length
            if chunk.completes:  # decodes from this iteration's step on
                self._prefilling.remove(chunk.seq)
                self._running.append(chunk.seq)

    def _step(self, seqs: list[Sequence], prefilled: int) -> None:
        """One verify pass over `seqs`; `prefilled` prompt tokens ran just before."""
        for seq in seqs:  # each runs its policy's (its table's cell's) controller at this occupancy
            seq.enter_step(len(seqs), self.rt.adaptive.controller_for)
        kind, steps = self._steps_in_one_call(seqs, prefilled)
        outputs = (self.runner.plain_steps(seqs, steps) if kind == "plain" else
                   self.runner.head_steps(seqs[0], steps) if kind == "head" else None)
        if not outputs:
            self._update(seqs, self.runner.verify(seqs), prefilled)
            return
        for out in outputs:
            self._update(seqs, out, 0)
            # Budgets and EOS end the call at its last step; a commit that failed (its caller's on_delta
            # raised) ends it early: the others' later picks are dropped and decoded again, so their
            # output is the same (the cache rows past their tokens are rewritten before any read).
            if any(seq.done.is_set() for seq in seqs):
                break

    def _steps_in_one_call(self, seqs: list[Sequence], prefilled: int) -> tuple[str, int]:
        """What this iteration may run as several steps in one kernel call -> (kind, up to how many steps):
        ("plain", n) where every sequence decodes plain (no drafts this step or in any step of its policy),
        greedy or sampled; ("head", n) for a greedy sequence alone drafting a chain with the draft head at
        temperature 0; both only for requests without stop strings whose controller does not adapt, and
        only while nobody waits to join (a newcomer, or a prompt still prefilling, would wait for the whole
        call). Else ("", 1). Plain calls never run past a budget; a head call stops where the budget leaves
        nothing to draft. Cancellation and deadlines are polled between calls, so they take effect up to n
        steps later; EOS ends a call after the step that commits it."""
        if self.steps_per_call < 2 or prefilled or self._prefilling or self._waiting:
            return "", 1
        if any(adapts(seq.controller) or seq.request.stop for seq in seqs):
            return "", 1
        if all(seq.draft_budget() == 0 and not seq.may_draft_with_model for seq in seqs):
            steps = min(self.steps_per_call, *(seq.remaining for seq in seqs))
            return ("plain", steps) if steps > 1 else ("", 1)
        policy = seqs[0].step_policy
        if (len(seqs) == 1 and self.rt.draft_is_head and seqs[0].request.sampling.greedy
                and policy.drafter is Drafter.MODEL and policy.draft_length > 0
                and policy.draft_temperature == 0 and policy.tree_width == 1 and seqs[0].draft_budget() > 0):
            return "head", self.steps_per_call
        return "", 1

    def _update(self, seqs: list[Sequence], out: VerifyOutput, prefilled: int) -> None:
        """Records, controllers and commits from a verify pass; finished sequences leave."""
        rt, lengths, verify_s = self.rt, out.lengths, out.verify_seconds
        pass_id = next(self._pass_ids)
        if len(seqs) == 1 and lengths[0] == 1:
            rt.clock.observe_plain_step(verify_s)
        records = rt.records
        own_unique, batch_unique = records.unions(out.routed, lengths)
        own_overlap = records.overlaps(out.routed, lengths)
        pass_record = records.pass_record(pass_id, lengths, out.routed, batch_unique, prefilled, out.start_ns,
                                          out.draft_seconds, verify_s)
        step_unit = rt.clock.decode_step_seconds()
        # Each window's routed ids, only where a record keeps them (top-k capture, the EP estimate): a
        # batched step does this loop for every request, so it does nothing a request does not need.
        trees = any(p.tree is not None for p in out.proposals)  # (a tree's record counts its branches' unions)
        window_ids = out.routed.split(lengths, dim=1) if records.keeps_ids or trees else [None] * len(seqs)
        adaptive = self._observe_controllers(seqs, out)
        finished = []
        for seq, proposal, window, ids, unique, overlap, (n_ok, flags, bonus) in zip(
                seqs, out.proposals, out.windows, window_ids, own_unique, own_overlap, out.accepted.verdicts,
                strict=True):
            drafts = proposal.drafts
            # (a chain's flags mark matches, not its accepted prefix; a tree's its accepted path)
            accepted = drafts[:n_ok] if proposal.tree is None else [d for d, ok in zip(drafts, flags, strict=True)
                                                                    if ok]
            k = len(drafts)
            if seq.step_policy.drafter is Drafter.MODEL and k > 0:
                # The draft cache holds the old tokens plus drafts 1..k-1. A dense draft's entries of
                # accepted drafts stay valid; a head's read its own feature estimates, so they are redone.
                # An EAGLE-3 draft's entries run one position behind the tokens (entry p reads the target at
                # p and token p + 1): its true entries end before the window's first token.
                seq.draft_valid = (len(seq.ids) - 1 if rt.draft_is_eagle3
                                   else len(seq.ids) + (0 if rt.draft_is_head else min(n_ok, k - 1)))
            record = records.step_record(seq, k, n_ok, window, ids, unique, proposal.seconds, verify_s, step_unit,
                                         pass_record, proposal.planned, overlap, proposal.tree, flags)
            try:
                finish = seq.commit([*accepted, bonus], record, rt.eos_id, rt.decode)
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
            rt.adaptive.observe_pass(sum(lengths), union, time.perf_counter() - out.verify_started,
                                     out.accepted.sampling_seconds, out.accepted.sampled_rows,
                                     plain=max(lengths) == 1, disturbed=prefilled > 0 or self._finished_last)
        for seq, finish in finished:
            self._finish(seq, finish)
        self._finished_last = bool(finished)

    def _observe_controllers(self, seqs: list[Sequence], out: VerifyOutput) -> bool:
        """Each controller hears its request's outcome -> whether any request adapts (then the
        engine's estimates learn from the step; a pass of static policies pays nothing for them)."""
        adaptive = any(adapts(s.controller) for s in seqs)
        seconds = out.verify_ended - out.drafting_started
        shared = []  # the controllers a policy's requests share: each hears the pass's end once
        for seq, proposal, (n_ok, _, _), w in zip(seqs, out.proposals, out.accepted.verdicts, out.lengths,
                                                   strict=True):
            controller = seq.controller
            if adaptive and (w > 1 or proposal.planned > 0 or controller.hears_plain_steps):
                controller.observe(StepOutcome(w - 1, n_ok, seconds, n_ok + 1, proposal.confidence, proposal.planned))
            if controller.shared:
                shared.append(controller)
            seq.last_window = w
        if shared:
            self.rt.adaptive.end_pass(shared, len(seqs))
        return adaptive
