"""Published draft-length rules, reimplemented from their descriptions as selectable controllers.

Each decides only how many drafts a step verifies (controller.py says why that keeps decoding
lossless). Where a rule was written for another engine, the adaptation is stated in its docstring.
"""

from __future__ import annotations

from service.engine.spec.adaptive.controller import DraftConfidence, StepContext, StepController, StepOutcome

# SGLang 0.5.23, sglang/srt/speculative/adaptive_spec_params.py, DEFAULT_ADAPTIVE_CONFIG: the
# candidate draft steps per batch-size tier (a batch uses the largest tier at or below its size).
SGLANG_TIERS = {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}
SGLANG_DOWN_HYSTERESIS = {1: -0.25, 8: 0.0, 32: 0.0, 64: 0.0}


class SglangTier:
    """One batch-size tier of SGLang's `--speculative-adaptive` (`AdaptiveStepSlot`).

    An EMA (alpha 0.2) of the batch's mean accepted drafts, updated after each verify while the
    tier drafts; after 10 warm-up batches, every 5th batch re-decides: from steps s it moves down
    while the EMA <= (previous candidate - 0.5, or 0.5 when that candidate is 0) + down hysteresis,
    else up while the EMA > s - 0.5 + up hysteresis (0); from 0 it probes the smallest positive
    candidate, restarting the EMA at that candidate - 1 if it had gone negative.
    """

    ALPHA, WARMUP, INTERVAL, UP_HYSTERESIS = 0.2, 10, 5, 0.0

    def __init__(self, candidates: tuple[int, ...], initial: int, down_hysteresis: float):
        self.candidates = sorted(set(candidates))
        self.down_hysteresis = down_hysteresis
        self.steps = initial if initial in self.candidates else self.candidates[len(self.candidates) // 2]
        self.ema = float(self.steps - 1)
        self.batches = 0

    def update(self, accepted: list[int]) -> None:
        if not accepted:
            return
        if self.steps > 0:
            self.ema = (1 - self.ALPHA) * self.ema + self.ALPHA * sum(accepted) / len(accepted)
        self.batches += 1
        if self.batches > self.WARMUP and (self.batches - self.WARMUP) % self.INTERVAL == 0:
            self._decide()

    def _decide(self) -> None:
        c, i = self.candidates, self.candidates.index(self.steps)
        if self.steps == 0:
            target = c[min(i + 1, len(c) - 1)]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            self.steps = target
            return
        start = i
        while i > 0:
            below = c[i - 1]
            threshold = (0.5 if below == 0 else below - 0.5) + self.down_hysteresis
            if self.ema > threshold:
                break
            i -= 1
        if i == start:
            while i < len(c) - 1 and self.ema > c[i] - 0.5 + self.UP_HYSTERESIS:
                i += 1
        self.steps = c[i]


class SglangEmaTiers(StepController):
    """SGLang 0.5.23's adaptive speculation, one object for every request of a policy (it decides
    per batch, as SGLang does). Its tiers' candidates are cut to the policy's draft_length (a tier
    left empty keeps its smallest candidate under it, else 0); SGLang's initial steps (its
    `--speculative-num-steps`) is the policy's draft_length."""

    shared = True

    def __init__(self, max_length: int):
        self.tiers = {}
        for size, candidates in SGLANG_TIERS.items():
            kept = tuple(k for k in candidates if k <= max_length) or (0,)
            self.tiers[size] = SglangTier(kept, max_length, SGLANG_DOWN_HYSTERESIS[size])
        self._accepted: list[int] = []

    def tier(self, batch_size: int) -> SglangTier:
        return self.tiers[max((s for s in self.tiers if s <= batch_size), default=min(self.tiers))]

    def plan(self, ctx: StepContext, limit: int) -> int:
        return min(limit, self.tier(ctx.batch_size).steps)

    def observe(self, outcome: StepOutcome) -> None:
        self._accepted.append(outcome.accepted)

    def end_pass(self, batch_size: int) -> None:
        self.tier(batch_size).update(self._accepted)
        self._accepted = []


class TransformersHeuristic(StepController):
    """transformers' assisted generation, `num_assistant_tokens_schedule="heuristic"` with
    `assistant_confidence_threshold` (transformers/generation/candidate_generator.py): the draft
    length starts at `num_assistant_tokens` (20, cut to the policy's draft_length), grows by 2 after a
    step whose every draft was accepted and shrinks by 1 (never below 1) otherwise; drafting stops
    after a draft whose own probability is below 0.4 (that draft is kept, as transformers'
    ConfidenceCriteria keeps the token that tripped it). Here the drafts past it are made and then
    dropped: the verify pass is transformers', the draft time is not. Where the drafter reports no
    probabilities (n-gram; the draft head drafting greedily) the threshold does not apply."""

    wants_confidence = True
    INITIAL, THRESHOLD = 20.0, 0.4

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = min(self.INITIAL, float(max_length))

    def plan(self, ctx: StepContext, limit: int) -> int:
        return min(limit, int(self.length))

    def cut(self, confidence: DraftConfidence) -> int:
        for i, p in enumerate(confidence.token):
            if p < self.THRESHOLD:
                return i + 1
        return len(confidence.token)

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.drafted > 0 and outcome.accepted == outcome.drafted:
            self.length = min(float(self.max_length), self.length + 2.0)
        else:
            self.length = max(1.0, self.length - 1.0)


class CascadeUtility(StepController):
    """Cascade (Saxena et al., "Utility-Driven Speculative Decoding for Mixture-of-Experts",
    arXiv 2506.20675), per request: a short test phase measures each candidate length's utility,
    the tokens it gains over plain decoding per unit of verification cost (its committed tokens per
    second over plain's), then a longer set phase runs the best; speculation is off for the set
    phase when no candidate's utility reaches 1. The paper runs it in vLLM; here a test phase is 3
    steps at each of 0, 1, draft_length // 2 and draft_length, and a set phase 32 steps (our
    choices: the paper fixes the phases' shape, not these lengths)."""

    TEST_STEPS, SET_STEPS = 3, 32

    def __init__(self, max_length: int):
        self.candidates = [0, *sorted({1, max(1, max_length // 2), max_length})]
        self.length = max_length
        self._begin_test()

    def _begin_test(self) -> None:
        self.queue = [c for c in self.candidates for _ in range(self.TEST_STEPS)]
        self.measured = {c: [0, 0.0] for c in self.candidates}  # tokens, seconds
        self.set_left = 0

    def plan(self, ctx: StepContext, limit: int) -> int:
        return min(limit, self.queue[0] if self.queue else self.length)

    def observe(self, outcome: StepOutcome) -> None:
        if self.queue:
            tokens_seconds = self.measured[self.queue.pop(0)]
            tokens_seconds[0] += outcome.committed
            tokens_seconds[1] += outcome.seconds
            if not self.queue:
                self._decide()
        else:
            self.set_left -= 1
            if self.set_left <= 0:
                self._begin_test()

    def utility(self, length: int) -> float:
        tokens, seconds = self.measured[length]
        plain_tokens, plain_seconds = self.measured[0]
        if seconds <= 0 or plain_tokens <= 0:
            return 0.0
        return (tokens / seconds) / (plain_tokens / plain_seconds)

    def _decide(self) -> None:
        best = max(self.candidates[1:], key=self.utility)
        self.length = best if self.utility(best) >= 1.0 else 0
        self.set_left = self.SET_STEPS
