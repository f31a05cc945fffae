"""Continuous batching: one scheduler thread owns the models and runs every request in flight.

Contract:
- Callers `submit` a Sequence and block until it is done; the scheduler thread is the only one that
  runs the models. Up to `max_batch` sequences run at once, each in its own KV-cache slot; more wait.
- One scheduler step = draft for every running sequence (its own policy: n-gram lookups per
  sequence, the draft model in batched ragged passes), then ONE target pass over all their windows
  `[last committed token, drafts...]` back to back (ragged), then per-sequence acceptance with the
  sequence's own sampling and generator (`accept`, `accept_greedy`, ... looked up in this module,
  imported from `service.engine.sampling`), commit, stop rules and streaming.
- Sequences join and leave between steps: newcomers are prefilled in one ragged pass of their own
  before the next step; a sequence whose `should_stop()` is true (cancel, deadline) leaves before
  the step, with what it has. `should_stop` is polled once per step, as before batching.
- Every step yields one StepRecord per sequence (its own window's union) and one BatchPassRecord
  for the pass (the union over every position of every sequence), attached to those StepRecords.
  Draft and verify seconds of a step are the pass's: what the request waited for.
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
from typing import TYPE_CHECKING

import torch

from service import expert_parallel
from service.engine import ngram
from service.engine.model import RaggedBatch
from service.engine.sampling import accept, accept_greedy, draft_probs, point_mass, sample, target_probs
from service.engine.sequence import Sequence
from service.types import BatchPassRecord, Drafter, FinishReason, GenerationResult, StepRecord

if TYPE_CHECKING:
    from service.engine.engine import Engine

logger = logging.getLogger(__name__)


def unique_experts_per_layer(routed: torch.Tensor, num_experts: int) -> tuple[int, ...]:
    """routed ids [L, w, m] -> distinct experts per layer: mark every expert any position picked."""
    L = routed.shape[0]
    touched = torch.zeros(L, num_experts, dtype=torch.bool).scatter_(1, routed.reshape(L, -1), True)  # [L, E]
    return tuple(touched.sum(-1).tolist())


class EngineClosed(RuntimeError):
    """The engine was closed while the request waited or ran."""


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        # Weak: the scheduler thread must not keep its engine alive (the engine's finalizer stops it).
        self._engine = weakref.ref(engine)
        self.max_batch = max_batch
        self._cv = threading.Condition()  # guards _waiting, _free_slots, _closed
        self._waiting: deque[Sequence] = deque()
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out slot 0 first
        self._closed = False
        self._running: list[Sequence] = []  # scheduler thread only
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
                    while not (self._waiting or self._running or self._closed):
                        self._cv.wait()
                    if self._closed:
                        leaving = self._running + list(self._waiting)
                        self._waiting.clear()
                        break
                    joining = []
                    while self._waiting and self._free_slots:
                        seq = self._waiting.popleft()
                        seq.slot = self._free_slots.pop()
                        joining.append(seq)
                self._run_guarded(self._join, joining)
                self._leave_stopped(skip=joining)
                if self._running:
                    self._run_guarded(self._step, list(self._running))
        for seq in leaving:
            self._finish(seq, FinishReason.CANCELLED)

    def _run_guarded(self, work, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        try:
            work(seqs)
        except Exception as error:  # a fault in a pass: its sequences fail, the others keep running
            logger.exception("engine pass failed for %d request(s)", len(seqs))
            for seq in seqs:
                if not seq.done.is_set():
                    self._release(seq)
                    seq.fail(error)

    def _join(self, joining: list[Sequence]) -> None:
        """Admit newcomers: a stopped one leaves at once; the rest are prefilled in one ragged pass."""
        ready = []
        for seq in joining:
            if self._stopped(seq):  # its deadline passed, or its caller left, while it waited
                if not seq.done.is_set():
                    self._finish(seq, FinishReason.CANCELLED)
            else:
                ready.append(seq)
        # Prefill all but the last prompt token: every output token then comes from a step whose
        # window starts at the last committed token, the first step included.
        prefill = [s for s in ready if s.prompt_len > 1]
        if prefill:
            lengths = [s.prompt_len - 1 for s in prefill]
            batch = RaggedBatch.build([s.slot for s in prefill], [0] * len(prefill), lengths)
            self.e.target.forward_ragged(torch.cat([s.tokens[:-1] for s in prefill]), batch, self.e.target_cache)
        self._running.extend(ready)

    def _leave_stopped(self, skip: list[Sequence]) -> None:
        # A newcomer was asked at admission; asking again would poll it twice before its first step.
        for seq in [s for s in self._running if s not in skip and self._stopped(s)]:
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
        if seq.slot >= 0:
            with self._cv:
                self._free_slots.append(seq.slot)
            seq.slot = -1

    # ------------------------------------------------------------------ one step
    def _step(self, seqs: list[Sequence]) -> None:
        e = self.e
        start_ns, t0 = time.time_ns(), time.perf_counter()
        proposals = self._draft(seqs)  # per sequence: (drafts [k'], q [k', V] or None, draft seconds)
        t1 = time.perf_counter()
        windows = [torch.cat([s.tokens[-1:], d]) for s, (d, _, _) in zip(seqs, proposals, strict=True)]  # [w_b]
        lengths = [w.shape[0] for w in windows]
        batch = RaggedBatch.build([s.slot for s in seqs], [s.tokens.shape[0] - 1 for s in seqs], lengths)
        out = e.target.forward_ragged(torch.cat(windows), batch, e.target_cache)
        logits, routed = out.logits.split(lengths), out.routed_ids.split(lengths, dim=1)  # [w_b, V], [L, w_b, m]
        verdicts = [self._accept(s, d, q, lg) for s, (d, q, _), lg in zip(seqs, proposals, logits, strict=True)]
        t2 = time.perf_counter()
        if len(seqs) == 1 and lengths[0] == 1:
            e.observe_plain_step(t2 - t1)
        pass_record = self._pass_record(lengths, out.routed_ids, start_ns, t1 - t0, t2 - t1)
        for seq, (drafts, _, draft_s), window, ids, (n_ok, flags, bonus) in zip(
                seqs, proposals, windows, routed, verdicts, strict=True):
            k = drafts.shape[0]
            if seq.policy.drafter is Drafter.MODEL and k > 0:
                # The draft cache holds the old tokens plus drafts 1..k-1; keep those that were accepted.
                seq.draft_valid = seq.tokens.shape[0] + min(n_ok, k - 1)
            record = self._record(seq, k, n_ok, flags, window, ids, draft_s, t2 - t1, pass_record)
            try:
                finish = seq.commit(torch.cat([drafts[:n_ok], bonus]), record, e.eos_id, e.decode)
            except Exception as error:  # e.g. the caller's on_delta raised: only this request fails
                self._release(seq)
                seq.fail(error)
                continue
            if finish is not None:
                self._finish(seq, finish)

    def _accept(self, seq: Sequence, drafts: torch.Tensor, q: torch.Tensor | None,
                logits: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        if seq.request.sampling.greedy:  # p is a point mass: acceptance is an exact prefix match
            return accept_greedy(drafts, logits.argmax(-1))
        p = target_probs(logits, seq.request.sampling)  # [w, V]
        return accept(drafts, q if q is not None else p[:0], p, seq.gen)

    # ------------------------------------------------------------------ drafting
    def _draft(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, torch.Tensor | None, float]]:
        """Each sequence's proposal under its own policy; the draft model runs batched over them."""
        cfg, vocab = self.e.config, self.e.info.vocab_size
        out: list[tuple[torch.Tensor, torch.Tensor | None, float]] = []
        model_rows: list[tuple[int, int]] = []  # (index in seqs, k)
        for i, seq in enumerate(seqs):
            k = seq.draft_budget()
            t0 = time.perf_counter()
            if k > 0 and seq.policy.drafter is Drafter.NGRAM:
                drafts = ngram.propose(seq.tokens, k, cfg.ngram_min, cfg.ngram_max)
                out.append((drafts, point_mass(drafts, vocab), time.perf_counter() - t0))
            else:
                out.append((seq.tokens[:0], None, 0.0))
                if k > 0:
                    model_rows.append((i, k))
        if model_rows:
            t0 = time.perf_counter()
            drafted = self._draft_with_model([seqs[i] for i, _ in model_rows], [k for _, k in model_rows])
            seconds = time.perf_counter() - t0
            for (i, _), (drafts, q) in zip(model_rows, drafted, strict=True):
                out[i] = (drafts, q, seconds)
        return out

    def _draft_with_model(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Draft k_b tokens for each sequence: round r is one ragged draft pass over the sequences
        still drafting; each first catches up on the committed tokens its draft cache lacks."""
        e = self.e
        pending = [s.tokens[s.draft_valid:] for s in seqs]  # tokens each still has to feed
        starts = [s.draft_valid for s in seqs]
        drafts: list[list[torch.Tensor]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for r in range(max(ks)):
            active = [b for b, k in enumerate(ks) if k > r]
            lengths = [pending[b].shape[0] for b in active]
            batch = RaggedBatch.build([seqs[b].slot for b in active], [starts[b] for b in active], lengths)
            logits = e.draft.forward_ragged(torch.cat([pending[b] for b in active]), batch, e.draft_cache).logits
            last = logits[torch.tensor(lengths).cumsum(0) - 1]  # [B', V] each sequence's last position
            for j, b in enumerate(active):
                row = last[j:j + 1]  # [1, V]
                temperature = seqs[b].policy.draft_temperature
                q = draft_probs(row, temperature)
                # A greedy draft's q is a point mass: its argmax is the sample, no random draw needed.
                token = row.argmax(-1) if temperature == 0 else sample(q, seqs[b].gen)
                drafts[b].append(token)
                qs[b].append(q)
                starts[b] += pending[b].shape[0]
                pending[b] = token
        return [(torch.cat(d), torch.cat(q)) for d, q in zip(drafts, qs, strict=True)]

    # ------------------------------------------------------------------ records
    def _pass_record(self, lengths: list[int], routed: torch.Tensor, start_ns: int, draft_s: float,
                     verify_s: float) -> BatchPassRecord:
        cfg = self.e.target.cfg
        L, E, m = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        N = sum(lengths)
        unique = unique_experts_per_layer(routed, E) if self.e.config.capture_routing else (0,) * L
        ep = {} if self.e.ep is None else expert_parallel.pass_fields(self.e.ep, routed, self.e.ep_token_bytes)
        return BatchPassRecord(pass_id=next(self._pass_ids), batch_size=len(lengths), positions=N,
                               windows=tuple(lengths), unique_experts=unique, unique_experts_bound=min(E, N * m),
                               draft_seconds=draft_s, verify_seconds=verify_s, start_time_ns=start_ns, **ep)

    def _record(self, seq: Sequence, drafted: int, accepted: int, flags: torch.Tensor, window: torch.Tensor,
                routed: torch.Tensor, draft_s: float, verify_s: float, batch: BatchPassRecord) -> StepRecord:
        e, policy = self.e, seq.policy
        cfg, capture = e.target.cfg, e.config.capture_topk or e.recorder is not None
        L, E, m = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        unique = unique_experts_per_layer(routed, E) if e.config.capture_routing else (0,) * L
        ep = {}  # the optional expert-parallel fields, estimated only with an EP size
        if e.ep is not None:
            ep = expert_parallel.step_fields(expert_parallel.pass_view(e.ep, routed, e.ep_token_bytes))
        return StepRecord(
            drafter=policy.drafter,
            draft_length=policy.draft_length,
            draft_temperature=policy.draft_temperature,
            policy_id=policy.policy_id,
            drafted=drafted,
            accepted=accepted,
            committed=accepted + 1,
            accepted_per_position=tuple(flags[:drafted].tolist()),
            window=window.shape[0],
            unique_experts=unique,
            shared_experts=1,
            unique_experts_bound=min(E, window.shape[0] * m),
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            decode_step_equivalents=verify_s / e.current_decode_step_seconds(),
            topk_ids=tuple(tuple(tuple(pos) for pos in layer) for layer in routed.tolist()) if capture else None,
            window_ids=tuple(window.tolist()) if capture else None,
            batch=batch,
            **ep,
        )
