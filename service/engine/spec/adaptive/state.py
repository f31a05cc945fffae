"""The engine-wide estimates every adaptive controller reads, fed by the scheduler after each pass.

One `AdaptiveState` per engine, on the scheduler thread. It learns the pass cost (estimates.PassCost),
the model drafter's seconds per position it feeds, the n-gram lookup's seconds, and per drafter the
acceptance by position and by confidence over every request of each kind (a new request's prior);
it tracks the moespec rule's calibration error (mean predicted minus observed acceptance of the
drafts it sent to verification) and hands out each request's controller.
"""

from __future__ import annotations

from service.engine.spec.adaptive.baselines import CascadeUtility, SglangEmaTiers, TransformersHeuristic
from service.engine.spec.adaptive.controller import StepContext, StepController
from service.engine.spec.adaptive.estimates import (
    AcceptanceByPosition,
    ConfidenceCalibration,
    DecayedRate,
    Ema,
    PassCost,
)
from service.engine.spec.adaptive.rule import MoespecRule
from service.types import MAX_DRAFT_LENGTH, Controller, Drafter, DraftPolicy

PLAIN_FIT_EVERY = 8  # passes without drafts per one the pass-cost fit sees


class AdaptiveState:
    def __init__(self, num_experts: int, top_k: int, plain_step_seconds: float):
        self.cost = PassCost(num_experts, top_k)
        self.plain_step_seconds = plain_step_seconds  # until passes are seen: the calibrated plain step
        # The model drafter's seconds per position it feeds: a step's first round feeds every token
        # its cache lacks (after a plain stretch, all of them), each later round one draft. Per round
        # instead, the catch-ups after plain stretches priced every draft at several positions'
        # cost: the rule then kept plain, its probes paid longer catch-ups, and it never drafted again.
        self.draft_position_seconds = Ema(0.1)
        self.lookup_seconds = Ema(0.1)  # the n-gram drafter's seconds per proposal (any length)
        # A sampled request's acceptance per verified row (its target_probs and accept): paid beside
        # the pass, by sampled requests only, so it is kept out of the pass-cost fit.
        self.sampled_row_seconds = Ema(0.1)
        # Keyed by (drafter, sampled): a sampled request accepts a draft by the target's probability of
        # it, a greedy one only on an exact match, so the two kinds' rates differ for the same drafts
        # and one shared prior would make a new request of either kind start from the other's.
        self.acceptance = {(d, s): AcceptanceByPosition(MAX_DRAFT_LENGTH, decay=0.999)
                           for d in Drafter for s in (False, True)}
        self.calibration = {(d, s): ConfidenceCalibration() for d in Drafter for s in (False, True)}
        # Per kind (sampled or not): the n-gram lookups that found a draft (a new request's prior).
        self.lookup_found = {s: DecayedRate(0.999) for s in (False, True)}
        self.calibration_bias = Ema(0.002)  # predicted - observed acceptance, per verified draft (~500 of them)
        self._plain_passes = 0  # passes without drafts since the last one the fit saw (mod PLAIN_FIT_EVERY)
        self.last_positions = 0  # the last verify pass's positions
        # (positions, drafter, sampled) -> (plain_step_share, each position's marginal seconds), kept
        # while the pass-cost fit is: every request of a kind at one pass size asks for the same.
        self._prices: dict[tuple[int, Drafter, bool], tuple[float, list[float]]] = {}
        self._prices_version = -1
        self._shared: dict[str, StepController] = {}  # policy id -> the controller its requests share
        self._passed: set[int] = set()  # ids of shared controllers in the current pass

    # -- read by the controllers ---------------------------------------------------------------
    def context(self, batch_size: int, own_last_window: int, draft_lag: int = 0) -> StepContext:
        """A request's view of the coming pass: the last pass without its own window (batch 1: empty),
        and the tokens its model-drafter cache lacks."""
        others = 0 if batch_size == 1 else max(0, self.last_positions - own_last_window)
        return StepContext(batch_size, others, draft_lag)

    def plain_step_share(self, positions: int, sampled: bool) -> float:
        """What one plain step costs a request in a pass of that many positions: its position's share
        of the pass (the fit's seconds over its positions; the calibrated plain step before any pass),
        plus, for a sampled request, its own acceptance of the row. Alone, the whole plain step.

        A share, not the pass: whatever the pass's other windows cost (the other sampled requests'
        acceptance above all) is paid whether this request drafts or not. Against the pass's
        seconds per token, which that cost fills, a position looks cheap in a full pass even where
        it costs more than the tokens it brings."""
        if not self.cost.passes:
            return self.plain_step_seconds + self.row_seconds(sampled)
        return self.cost.seconds(positions) / positions + self.row_seconds(sampled)

    def step_prices(self, positions: int, drafter: Drafter, sampled: bool) -> tuple[float, list[float]]:
        """What a request of that kind pays in a pass of that many positions: a plain step
        (`plain_step_share`), and each of the MAX_DRAFT_LENGTH positions it may add after them (the
        pass's marginal, a position the drafter feeds, its own acceptance of one more row; not the
        first draft's extra, `first_draft_seconds`). Recomputed when the pass-cost fit is solved
        anew, every few passes; the drafting and row estimates are read then too."""
        if self._prices_version != self.cost.version:
            self._prices.clear()
            self._prices_version = self.cost.version
        key = (positions, drafter, sampled)
        prices = self._prices.get(key)
        if prices is None:
            extra = self.draft_seconds(drafter) + self.row_seconds(sampled)
            prices = (self.plain_step_share(positions, sampled),
                      [m + extra for m in self.marginals(positions, MAX_DRAFT_LENGTH)])
            self._prices[key] = prices
        return prices

    def marginals(self, positions: int, count: int) -> list[float]:
        """Each of `count` more positions in a pass of that many: the fit's marginals, or before any
        pass a whole calibrated plain step (nothing is known of longer passes yet: drafting waits for
        a probe)."""
        return self.cost.marginals(positions, count) if self.cost.passes else [self.plain_step_seconds] * count

    def row_seconds(self, sampled: bool) -> float:
        """What one more verified row costs a request beyond the pass: its sampled acceptance."""
        return self.sampled_row_seconds.get(0.0) if sampled else 0.0

    def draft_seconds(self, drafter: Drafter) -> float:
        """Seconds one more draft position costs: a position the model drafter feeds; an n-gram
        proposal costs the same at any length (`first_draft_seconds`)."""
        return self.draft_position_seconds.get(0.0) if drafter is Drafter.MODEL else 0.0

    def first_draft_seconds(self, drafter: Drafter, draft_lag: int = 0) -> float:
        """What drafting at all costs beyond the per-position cost: the n-gram lookup, or the model
        drafter's catch-up on the tokens its cache lacks beyond the one the first round feeds anyway."""
        if drafter is Drafter.NGRAM:
            return self.lookup_seconds.get(0.0)
        return max(0, draft_lag - 1) * self.draft_position_seconds.get(0.0)

    @property
    def calibration_error(self) -> float:
        """|mean predicted - mean observed| acceptance of the moespec rule's verified drafts (0 until seen)."""
        return abs(self.calibration_bias.get(0.0))

    # -- fed by the scheduler ------------------------------------------------------------------
    def observe_pass(self, positions: int, union_per_layer: float, step_seconds: float,
                     sampling_seconds: float = 0.0, sampled_rows: int = 0, plain: bool = False,
                     disturbed: bool = False) -> None:
        """step_seconds: what the step paid after drafting (the verify pass and everything a window's
        length adds to the step). It includes the sampled requests' acceptance (sampling_seconds over
        sampled_rows rows), which only sampled requests pay: the pass-cost fit sees the step without
        it. Of the passes without drafts (`plain`) only every PLAIN_FIT_EVERY-th feeds the fit: while
        the rule keeps plain they repeat one point of the fit, and the update was most of the rule's
        cost per step. A `disturbed` pass (right after a prefill pass, or after a step in which
        requests finished) does not feed it: it pays for what runs around it, whatever its windows
        (most likely the prompt evicting the weights from the caches, and the callers' threads
        building results and submitting requests beside it). At 16 clients such passes of 14 and 15 positions cost
        30-60% more than the steady passes of 16 around them, and in the fit they made the drafted
        passes' extra positions look nearly free: the rule drafted where drafts cost ~4x the fit's
        price, and ran at ~0.94x plain where, kept plain, it ran at 1.00x."""
        self._plain_passes = (self._plain_passes + 1) % PLAIN_FIT_EVERY if plain else 0
        if self._plain_passes == 0 and not disturbed:
            self.cost.observe(positions, union_per_layer, step_seconds - sampling_seconds)
        if sampled_rows:
            self.sampled_row_seconds.update(sampling_seconds / sampled_rows)
        self.last_positions = positions

    def observe_lookup(self, seconds: float) -> None:
        self.lookup_seconds.update(seconds)

    def observe_draft_positions(self, positions: int, seconds: float) -> None:
        """The model drafter fed `positions` (catch-ups and chains of every request it drafted for)."""
        if positions > 0:
            self.draft_position_seconds.update(seconds / positions)

    def observe_predictions(self, predicted: list[float], accepted: int) -> None:
        """The rates the verified drafts were sent with, of the positions verification reached; the
        first `accepted` of them were accepted."""
        bias = self.calibration_bias  # its EMA updates inline: one per verified draft of every step
        value, alpha = bias.value, bias.alpha
        for i, rate in enumerate(predicted):
            error = rate - (i < accepted)
            value = error if value is None else value + alpha * (error - value)
        bias.value = value

    # -- controllers ---------------------------------------------------------------------------
    def controller_for(self, policy: DraftPolicy, cell: str = "", greedy: bool = True) -> StepController:
        """A request's controller for a policy (a table's cell: `cell` its label; `greedy`: the
        request's kind): per request, or the one that policy's requests share."""
        kind = policy.controller if policy.draft_length > 0 else Controller.STATIC
        if kind is Controller.MOESPEC:
            return MoespecRule(self, policy.drafter, policy.cost_weight, sampled=not greedy)
        if kind is Controller.TRANSFORMERS:
            return TransformersHeuristic(policy.draft_length)
        if kind is Controller.CASCADE:
            return CascadeUtility(policy.draft_length)
        if kind is Controller.SGLANG:
            key = f"{policy.policy_id}\0{cell}\0{policy.drafter}\0{policy.draft_length}"
            if key not in self._shared:
                self._shared[key] = SglangEmaTiers(policy.draft_length)
            return self._shared[key]
        return StepController()

    def end_pass(self, shared: list[StepController], batch_size: int) -> None:
        """Tell each shared controller of the pass, once, that the pass is over."""
        self._passed.clear()
        for c in shared:
            if id(c) not in self._passed:
                self._passed.add(id(c))
                c.end_pass(batch_size)
