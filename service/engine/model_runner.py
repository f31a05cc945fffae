"""Runs what the scheduler decided: a prefill pass over prompt chunks, or a verify pass over the
windows of the running sequences.

A verify pass: each sequence proposes its drafts (spec/drafting.py, its own policy and controller),
ONE target pass runs over every window `[last committed token, drafts...]` back to back (ragged), and
each window gets its verdict (spec/acceptance.py). The runner keeps the model-side state in step
(the draft cache, the features the draft head reads) and times the pass; it commits nothing: the
scheduler updates the sequences, the records and the controllers from its `VerifyOutput`. Greedy steps
that need no Python between them can also run several to one kernel call (`plain_steps`, `head_steps`):
one `VerifyOutput` per step, as `verify` would have returned for each.

Shape legend: B sequences in a pass, N tokens in it, w a window, L layers, m experts per token, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from service.engine.kernels.forward import StepSampling
from service.engine.model.ragged import RaggedBatch
from service.engine.runtime import Runtime
from service.engine.sequence import Sequence
from service.engine.spec.acceptance import PassVerdicts, accept_pass
from service.engine.spec.drafting import Proposal, draft, uses_head

__all__ = ["ModelRunner", "PrefillChunk", "VerifyOutput"]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start+length) of a sequence, riding in one pass."""

    seq: Sequence
    start: int
    length: int
    completes: bool  # the prompt's last chunk

    def tokens(self) -> list[int]:
        return self.seq.ids[self.start:self.start + self.length]


@dataclass(frozen=True)
class VerifyOutput:
    proposals: list[Proposal]  # [B] each sequence's drafts
    windows: list[list[int]]  # [B] each window's tokens: [last committed token, drafts...]
    lengths: list[int]  # [B] each window's length
    routed: torch.Tensor  # [L, N, m] the routed ids of every position of the pass
    accepted: PassVerdicts
    start_ns: int  # wall clock at the start of drafting
    drafting_started: float  # perf_counter at the start of drafting
    verify_started: float  # perf_counter at the start of the target pass (drafting's end)
    verify_ended: float  # perf_counter after the verdicts

    @property
    def draft_seconds(self) -> float:
        return self.verify_started - self.drafting_started

    @property
    def verify_seconds(self) -> float:
        return self.verify_ended - self.verify_started


class ModelRunner:
    def __init__(self, runtime: Runtime):
        self.rt = runtime

    def prefill(self, chunks: list[PrefillChunk]) -> None:
        """One target pass over prompt chunks (no verify windows): their keys/values go to the cache."""
        rt = self.rt
        tokens = torch.tensor([t for c in chunks for t in c.tokens()])
        batch = RaggedBatch.build([c.seq.slot for c in chunks], [c.start for c in chunks], [c.length for c in chunks])
        # A draft head reads the target's features of the prompt too (one more MLP per pass).
        head_users = (rt.draft_is_head or rt.draft_is_eagle3) and any(uses_head(c.seq) for c in chunks)
        # An EAGLE-3 draft reads the captured layer outputs instead of the final features.
        features = rt.target.fill_cache(tokens, batch, rt.target_cache, features=head_users,
                                        capture=rt.target_capture if head_users else ())
        if features is not None:
            rt.target_features[batch.token_slot, batch.positions] = features
        self._prefill_dense_draft(chunks)

    def _prefill_dense_draft(self, chunks: list[PrefillChunk]) -> None:
        """A dense draft model's cache takes the prompt chunks of the sequences that draft with it in the
        same prefill pass: their first step then drafts at once instead of catching up on the whole
        prompt (prefill work, timed as prefill, as llama.cpp's speculative decoding times it)."""
        rt = self.rt
        if rt.draft is None or rt.draft_is_head or rt.draft_is_eagle3:
            return
        dense = [c for c in chunks if uses_head(c.seq) and c.seq.draft_valid == c.start]
        if not dense:
            return
        tokens = torch.tensor([t for c in dense for t in c.tokens()])
        batch = RaggedBatch.build([c.seq.slot for c in dense], [c.start for c in dense], [c.length for c in dense])
        rt.draft.fill_cache(tokens, batch, rt.draft_cache)
        for chunk in dense:
            chunk.seq.draft_valid = chunk.start + chunk.length

    def verify(self, seqs: list[Sequence]) -> VerifyOutput:
        """Drafts, one target pass over every window, verdicts."""
        rt = self.rt
        start_ns, t0 = time.time_ns(), time.perf_counter()
        proposals = draft(rt, seqs)  # per sequence: its drafts, q [k', V] or None, draft seconds, confidences
        t1 = time.perf_counter()
        windows = [[s.ids[-1], *p.drafts] for s, p in zip(seqs, proposals, strict=True)]  # [w_b]
        lengths = [len(w) for w in windows]
        trees = [p.window_parents for p in proposals]
        trees = trees if any(t is not None for t in trees) else None
        batch = RaggedBatch.build([s.slot for s in seqs], [len(s.ids) - 1 for s in seqs], lengths,
                                  tokens=[t for w in windows for t in w], trees=trees)
        capture = rt.target_capture if any(uses_head(s) for s in seqs) else ()
        out = rt.target.forward_ragged(batch.tokens, batch, rt.target_cache, capture=capture)
        if rt.draft_is_head and any(uses_head(s) for s in seqs):  # what the head's next catch-up reads
            rt.target_features[batch.token_slot, batch.positions] = out.features
        elif capture:  # what an EAGLE-3 draft's next catch-up reads
            rt.target_features[batch.token_slot, batch.positions] = out.aux
        accepted = accept_pass(seqs, proposals, out.logits, lengths, out.argmax, rt.sampler)
        if trees is not None:  # (a chain's accepted drafts sit where they belong already)
            self._keep_accepted_paths(seqs, proposals, accepted)
        return VerifyOutput(proposals, windows, lengths, out.routed_ids, accepted, start_ns, t0, t1,
                            time.perf_counter())

    def plain_steps(self, seqs: list[Sequence], steps: int) -> list[VerifyOutput] | None:
        """Up to `steps` plain steps of `seqs` in one kernel call (the target's `decode_steps`: each step's
        picks feed the next, a greedy request's the argmax, a sampled one's a draw in C; ending early after
        a step that picks EOS) -> one VerifyOutput per step run, as `verify` would have returned for each:
        no drafts, each window the token the step read, its verdict the step's pick, its seconds the step's
        own. None where the target cannot run the steps in one call (the caller then steps one pass at a
        time).

        A sampled request's draws are its own generator's, one uniform a step, as a pass at a time would
        take them (`acceptance.plain_sampled_tokens`): drawn before the call for every step it may run,
        and where it ends early the generator is set back and advanced by the steps that ran, so its
        output never depends on what else shared the call.

        Why: at the shipped model's size a plain step's forward takes ~0.23 ms and the Python around it
        (the batch, the verdicts, the scheduler's iteration) ~0.1 ms more, most of it because the forward
        evicts the interpreter's working set; here the steps' Python runs once per call, warm."""
        rt = self.rt
        if not rt.target.runs_in_one_call(len(seqs)):
            return None
        first = [s.ids[-1] for s in seqs]
        batch = RaggedBatch.build([s.slot for s in seqs], [len(s.ids) - 1 for s in seqs], [1] * len(seqs),
                                  tokens=first)
        sampled = [s for s in seqs if not s.request.sampling.greedy]
        states = [s.gen.get_state() for s in sampled]
        sampling = _step_sampling(seqs, steps) if sampled else None
        start_ns, started = time.time_ns(), time.perf_counter()
        picks, routed, seconds = rt.target.decode_steps(batch, rt.target_cache, steps, rt.eos_id, sampling)
        if len(seconds) < steps:  # the unused draws handed back
            for seq, state in zip(sampled, states, strict=True):
                seq.gen.set_state(state)
                for _ in seconds:
                    torch.rand(1, generator=seq.gen)
        proposals, lengths = [Proposal([], None, 0.0) for _ in seqs], [1] * len(seqs)
        outputs, read = [], first
        for step, (picked, step_seconds) in enumerate(zip(picks.tolist(), seconds, strict=True)):
            # (no sampling seconds or rows of its own: a draw ran inside the kernel's step, in its seconds)
            verdicts = PassVerdicts([(0, (), token) for token in picked], 0.0, 0)
            ended = started + step_seconds
            outputs.append(VerifyOutput(proposals, [[token] for token in read], lengths, routed[step], verdicts,
                                        start_ns, started, started, ended))
            start_ns += round(step_seconds * 1e9)
            started, read = ended, picked
        return outputs

    def head_steps(self, seq: Sequence, steps: int) -> list[VerifyOutput] | None:
        """Up to `steps` greedy speculative steps of one sequence drafting a chain with the draft head at
        temperature 0, in one kernel call (the target's `head_greedy_steps`: the head's catch-up and chain,
        the verify pass, the greedy verdict, each step's commit feeding the next, ending early after EOS or
        where the budget leaves nothing to draft) -> one VerifyOutput per step run, as `verify` would have
        returned for each. None where the engine cannot run them in one call."""
        rt, k = self.rt, seq.step_policy.draft_length
        if not (rt.draft_is_head and rt.head_chain is not None and seq.draft_valid >= 1
                and rt.target.runs_in_one_call(k + 1)):
            return None
        start_ns, started = time.time_ns(), time.perf_counter()
        ran = rt.target.head_greedy_steps(rt.head_chain, rt.draft.kernel_threads.pool, rt.target_cache,
                                          rt.target_features, seq.slot, seq.ids, seq.draft_valid, k, seq.remaining,
                                          rt.eos_id, steps)
        outputs, last, lag = [], seq.ids[-1], len(seq.ids) - seq.draft_valid
        for drafts, matches, n_ok, bonus, routed, (draft_s, verify_s) in zip(
                ran.drafts, ran.matches, ran.accepted, ran.bonus, ran.routed, ran.seconds, strict=True):
            rt.adaptive.observe_draft_positions(lag + len(drafts) - 1, draft_s)  # (as `draft` tells it)
            drafted = started + draft_s
            outputs.append(VerifyOutput([Proposal(drafts, None, draft_s, planned=len(drafts))], [[last, *drafts]],
                                        [len(drafts) + 1], routed, PassVerdicts([(n_ok, matches, bonus)], 0.0, 0),
                                        start_ns, started, drafted, drafted + verify_s))
            start_ns += round((draft_s + verify_s) * 1e9)
            started, last, lag = drafted + verify_s, bonus, n_ok + 1
        return outputs

    def _keep_accepted_paths(self, seqs: list[Sequence], proposals: list[Proposal], accepted: PassVerdicts) -> None:
        """A tree's nodes took rows b + 1 + i of the target cache (b: the window's first token); its accepted
        path's keys and values (roped by depth, so valid at any row) and features move to rows b + 1, b + 2,
        .. where the committed tokens now sit. The rows past them are stale, as a chain's rejected rows are,
        and never read: every later window overwrites them before it attends."""
        rt = self.rt
        for seq, proposal, (_, on_path, _) in zip(seqs, proposals, accepted.verdicts, strict=True):
            if proposal.tree is None:
                continue
            base = len(seq.ids)  # b + 1: the first node's row and the first committed draft's position
            path = [i for i, ok in enumerate(on_path) if ok]
            moves = [(base + i, base + depth) for depth, i in enumerate(path) if i != depth]
            if not moves:
                continue
            source, target = torch.tensor([m[0] for m in moves]), torch.tensor([m[1] for m in moves])
            # Ascending: a node's index is at least its depth, so no move overwrites a row still to be read.
            for cache in (rt.target_cache.k, rt.target_cache.v):
                cache[:, seq.slot, :, target] = cache[:, seq.slot, :, source]
            if rt.target_features is not None:
                rt.target_features[seq.slot, target] = rt.target_features[seq.slot, source]


def _step_sampling(seqs: list[Sequence], steps: int) -> StepSampling:
    """How each row of a `decode_steps` call picks: a greedy request's argmax (temperature 0), a sampled
    one's draw with its settings and `steps` uniforms from its own generator, one per step in order (the
    ones a pass at a time would draw)."""
    params = [s.request.sampling for s in seqs]
    uniforms = torch.zeros(steps, len(seqs))
    for b, seq in enumerate(seqs):
        if not params[b].greedy:
            uniforms[:, b] = torch.cat([torch.rand(1, generator=seq.gen) for _ in range(steps)])
    return StepSampling.of(torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
                           torch.tensor([p.top_k for p in params], dtype=torch.long),
                           torch.tensor([p.top_p for p in params], dtype=torch.float32), uniforms)
