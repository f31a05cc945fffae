"""One request in flight: its tokens, random stream, step records, stop rules and streaming.

The scheduler owns every `Sequence` and calls it from its own thread only; the caller that
submitted it waits on `done`. Nothing here runs the model: the scheduler prefills the prompt in
chunks (`prefilled` counts what the target cache holds), then hands each sequence the tokens a step
committed (`commit`) and the sequence applies EOS, stop strings and the budget, streams what is
final and, once finished, builds the result. Token ids are kept as a Python list: the scheduler
reads a few of them per step, and a tensor grown by `torch.cat` every step cost more than the reads.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from service.engine.spec.adaptive.controller import StepController
from service.engine.spec.ngram import NgramIndex
from service.types import (
    Drafter,
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    StepRecord,
    StreamDelta,
)


class Sequence:
    def __init__(self, request: GenerationRequest, policy: DraftPolicy, prompt: list[int], budget: int,
                 should_stop: Callable[[], bool] | None, on_delta: Callable[[StreamDelta], None] | None):
        self.request, self.policy = request, policy
        # A table's cells run under the table's id (the request's); -1 is the base policy.
        self._cell_policies = {i: dataclasses.replace(c.policy, policy_id=policy.policy_id)
                               for i, c in enumerate(policy.cells)} | {-1: policy}
        self.may_draft_with_model = Drafter.MODEL in policy.drafters  # in some cell: its draft cache is kept
        self.prompt_len = len(prompt)
        self.ids: list[int] = list(prompt)  # prompt + committed tokens
        self.prefilled = 0  # prompt tokens whose keys/values the target cache holds (up to prompt_len - 1)
        self.budget = budget  # new tokens allowed: max_new_tokens, cut to what the context holds
        self.should_stop = should_stop or (lambda: False)
        self.on_delta = on_delta
        seed = request.sampling.seed
        # Its own generator: the tokens for a fixed seed never depend on what else is in the batch.
        self.gen = torch.Generator()
        if seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(seed)
        self.slot = -1  # cache slot, assigned when the scheduler admits it
        self.draft_valid = 0  # tokens of self.ids whose keys/values the draft cache holds
        self.ngram: NgramIndex | None = None  # its n-gram lookup, made on its first n-gram draft
        self.step_policy = policy  # the policy (the table's cell) its current step runs
        self.cell = ""  # that cell's label ("" for the base policy)
        self.controller = StepController()  # that policy's controller (`enter_step`)
        self._controllers: dict[int, StepController] = {}  # cell index -> its controller, made on first use
        self.last_window = 0  # positions of its window in the last step
        self.steps: list[StepRecord] = []
        self.sent_chars = 0  # completion text already streamed
        self.holdback = max((len(s) for s in request.stop), default=1) - 1
        self.t0 = time.perf_counter()  # submitted: queueing counts in the request's wall time
        self.ttft = 0.0
        self.done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None

    @property
    def completion(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.budget - (len(self.ids) - self.prompt_len)

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill. All but the last: every output token then comes from a
        step whose window starts at the last committed token, the first step included."""
        return self.prompt_len - 1 - self.prefilled

    def enter_step(self, batch_size: int, make_controller: Callable[[DraftPolicy, str, bool], StepController]) -> None:
        """Pick the policy this step runs (a table's cell, by the pass's occupancy and the request's
        kind) and its controller, made by `make_controller(policy, cell label, greedy)`; each cell
        keeps its own controller for the whole request."""
        greedy = self.request.sampling.greedy
        index, _ = self.policy.for_step(batch_size, greedy)
        self.step_policy = self._cell_policies[index]
        self.cell = self.policy.cells[index].label if index >= 0 else ""
        controller = self._controllers.get(index)
        if controller is None:
            controller = self._controllers[index] = make_controller(self.step_policy, self.cell, greedy)
        self.controller = controller

    def draft_budget(self) -> int:
        """Drafts this step may propose (its controller chooses how many of them): never past the
        budget (the target adds one token itself)."""
        return min(self.step_policy.draft_length, self.remaining - 1)

    def commit(self, new_ids: list[int], record: StepRecord, eos_id: int | None,
               decode: Callable[[list[int]], str]) -> FinishReason | None:
        """Append committed tokens, apply EOS / stop strings / budget, stream what is final.

        EOS ends the output (it is kept in token_ids, not in the text); tokens a step committed
        after it are dropped, so that step's `committed` counts only what reached the output.
        """
        finish = None
        if eos_id in new_ids:
            new_ids = new_ids[:new_ids.index(eos_id) + 1]
            finish = FinishReason.STOP
            record = dataclasses.replace(record, committed=len(new_ids))
        self.steps.append(record)
        self.ttft = self.ttft or time.perf_counter() - self.t0
        self.ids.extend(new_ids)
        # The text so far, only for whoever reads it every step: stop strings and streaming (decoding
        # the whole completion each step costs more as it grows; `finish` decodes it once).
        text = decode(self.completion) if self.request.stop or self.on_delta is not None else ""
        cut = self._stop_index(text)
        if cut is not None:
            text, finish = text[:cut], FinishReason.STOP
        elif finish is None and self.remaining <= 0:
            finish = FinishReason.LENGTH
        if self.on_delta is not None:
            self._stream(text, new_ids, record, final=finish is not None)
        return finish

    def finish(self, reason: FinishReason, decode: Callable[[list[int]], str], num_layers: int) -> None:
        completion = self.completion
        text = decode(completion)
        cut = self._stop_index(text)
        if cut is not None:
            text = text[:cut]
        self.result = GenerationResult(
            text=text,
            token_ids=tuple(completion),
            finish_reason=reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(completion),
            spec=SpecStats.from_steps(self.steps, self.policy, num_layers),
            steps=tuple(self.steps),
            seconds=time.perf_counter() - self.t0,
            time_to_first_token=self.ttft,
        )
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        return min(hits) if hits else None

    def _stream(self, text: str, new_ids: list[int], record: StepRecord, final: bool) -> None:
        # Hold back a possible partial stop string and an incomplete UTF-8 sequence until final.
        end = len(text) if final else len(text) - self.holdback
        while not final and end > self.sent_chars and text[end - 1] == "\ufffd":
            end -= 1
        delta = text[self.sent_chars:max(end, self.sent_chars)]
        self.sent_chars += len(delta)
        self.on_delta(StreamDelta(text=delta, token_ids=tuple(new_ids), step=record))
