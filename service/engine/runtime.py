"""What a step needs, in one object: the models, their caches, the features the draft head reads,
the adaptive state, the step clock and the record settings.

`Engine` builds one `Runtime` at start-up and hands it to the scheduler, which hands it to the model
runner and the drafters. Nothing here knows about requests, threads or the server: the scheduler
decides which sequences run, the model runner runs them on this, step_records describes what ran.

Shape legend: S slots (the scheduler's batch places), C context positions, H hidden size.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.kernels.head import HeadWeights
from service.engine.kernels.library import Kernels
from service.engine.model.draft_head import DraftHead
from service.engine.model.eagle3 import Eagle3Draft
from service.engine.model.ragged import KVCache
from service.engine.model.transformer import Transformer
from service.engine.spec.adaptive.state import AdaptiveState
from service.engine.step_records import StepRecords

__all__ = ["Runtime", "StepClock"]


class StepClock:
    """The unit of `decode_step_equivalents`: the median of the recent plain (one-position, one
    request) verify passes, so it follows the machine's current speed; the start-up calibration
    until there are 8 (a busy CPU at start-up would distort a fixed unit). Plain steps run several to a
    kernel call count with each step's own seconds: the unit is a plain step as this engine runs them."""

    def __init__(self, calibrated_seconds: float, recent: int = 64):
        self.calibrated_seconds = calibrated_seconds
        self._plain_steps: deque[float] = deque(maxlen=recent)  # in arrival order
        self._sorted: list[float] = []  # the same values in order: the median without a sort every step

    def observe_plain_step(self, seconds: float) -> None:
        if len(self._plain_steps) == self._plain_steps.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._plain_steps[0])]
        self._plain_steps.append(seconds)
        bisect.insort(self._sorted, seconds)

    def decode_step_seconds(self) -> float:
        n = len(self._sorted)
        if n < 8:
            return self.calibrated_seconds
        return self._sorted[n // 2] if n % 2 else (self._sorted[n // 2 - 1] + self._sorted[n // 2]) / 2


@dataclass
class Runtime:  # (not frozen: a test makes another token the EOS)
    target: Transformer
    target_cache: KVCache  # S slots of C positions
    # a dense draft model, the draft head, an EAGLE-3 draft, or none (n-gram only)
    draft: Transformer | DraftHead | Eagle3Draft | None
    draft_cache: KVCache | None
    # [S, C, H] the target's features per slot and position: what the draft head's catch-up reads;
    # for an EAGLE-3 draft [S, C, n*H], the target's captured layer outputs (None for other drafts).
    target_features: torch.Tensor | None
    head_chain: HeadWeights | None  # the head's drafting chain in one C call (None: the torch rounds run)
    # The head's temperature that makes its probabilities the target's greedy token's (spec/tree_calibration.py):
    # how a top-candidate tree ranks its candidates for greedy requests.
    tree_greedy_tau: float
    adaptive: AdaptiveState
    clock: StepClock
    records: StepRecords
    ngram_sizes: tuple[int, int]  # (shortest, longest) n-gram the n-gram drafter matches
    eos_id: int | None
    decode: Callable[[list[int]], str]  # token ids -> text (the tokenizer's, special tokens skipped)
    # The kernels that decide sampled requests' plain steps and chains (spec/acceptance.py); None: the
    # torch path (no kernels, or a test's rule swapped in where the torch path looks it up).
    sampler: Kernels | None = None

    @property
    def draft_is_head(self) -> bool:
        return isinstance(self.draft, DraftHead)

    @property
    def draft_is_eagle3(self) -> bool:
        return isinstance(self.draft, Eagle3Draft)

    @property
    def target_capture(self) -> tuple[int, ...]:
        """The target layers whose outputs the draft reads (an EAGLE-3 draft's aux layers; else none)."""
        return self.draft.cfg.aux_layer_ids if isinstance(self.draft, Eagle3Draft) else ()

    @property
    def num_layers(self) -> int:
        return self.target.cfg.num_hidden_layers
