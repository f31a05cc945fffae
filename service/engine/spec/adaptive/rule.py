"""moespec's rule: draft one more position only while its expected gain is worth its marginal cost.

Per request and step. Position i (0 = the first draft) adds a token iff it and every draft before
it are accepted: probability P_i = a_0 * ... * a_i, where a_j is the conditional acceptance of
position j. Without drafts this request's step costs it S seconds for T = 1 token: its position's
share of the pass it joins (the pass's seconds over its positions, the other windows as in the last
pass) plus, for a sampled request, its own acceptance of the row (state.plain_step_share). One more
position costs m_i, its marginal step seconds at the size the pass will have (the verify pass and
what the step's bookkeeping pays per position), which on an MoE target follows how many new experts
one more position brings (estimates.PassCost), plus one more position the model drafter feeds
(the first also pays the catch-up on the tokens its cache lacks, all of a plain stretch's; the
n-gram drafter's lookup is priced apart, below), plus, for a sampled request, its own
acceptance of one more row (target probabilities and the accept test, paid beside the pass and only
by sampled requests: state.row_seconds). Adding it lowers this request's seconds per token S / T iff

    P_i * S / T > m_i        (drafted with cost_weight * m_i on the right)

so the rule drafts positions while that holds, adding m_i to S and P_i to T, and stops at the
first that fails. Alone, S is a whole plain step, and on a memory-bound pass a position costs a
fraction of it; in a full pass the share shrinks towards what a position costs, and only drafts
that are nearly sure to be accepted pay. In a closed loop of clients the server's tokens per second
follow the work each token costs, so a request's own seconds per token is what the rule lowers,
never the pass's (the other requests' costs are paid whatever this one drafts).
0 drafts (plain) is always reachable; `cost_weight` is the tuner's knob (> 1: more cautious).

Where a_j comes from:
- before drafting: the request's own decayed acceptance at position j, shrunk towards every
  request of its kind (the drafter's engine-wide rate for greedy or for sampled requests), so a new
  request starts from what the engine knows of requests like it;
- after drafting, where the drafter reports confidences (the dense draft model; the draft head
  when it samples): the calibrated acceptance of a draft whose distribution's largest probability
  was that high (estimates.ConfidenceCalibration, per request kind too), and the drafts are cut
  where the condition fails. Both are calibrated online: every verify outcome updates them, and
  the state tracks the mean predicted-minus-observed acceptance (the calibration error).
  For the n-gram drafter these rates are of the drafts a lookup finds; whether it finds any is its
  own rate (per request, shrunk towards its kind's), and the lookup is asked for only where the
  positions it would find pay for it (`_lookup_pays`).
After 16 plain steps in a row the rule verifies two drafts, so estimates that went stale while it
was not drafting can recover, the acceptance past the first position included, and the pass-cost
fit sees windows of three positions (probes of one draft showed it windows of one and two only, and
from those it priced every position at a whole step: a greedy request whose drafts paid stopped
drafting for good). A probe costs two marginal positions once per 16 steps; after a
rejected probe the next waits twice as long, up to 128 steps, and an accepted one or a decision
to draft starts over from 16. In a pass of B requests the wait is B times as long: every
request's probes feed the same engine-wide estimates of its kind, so the pass carries about one
probe per 16 passes at any occupancy (one per request every 16 steps put a probe in most 16-request
passes, and their drafts, rows and pass-cost updates cost those passes more than plain).
Once it chose plain, it keeps plain without pricing for the next RECHECK_EVERY - 1 steps at the
same batch size, twice as many after each plain decision in a row up to MAX_RECHECK (estimates
move over tens of passes, and pricing every step of a long plain stretch is the rule's whole
overhead there); a decision to draft, or a probe, starts over from RECHECK_EVERY.
"""

from __future__ import annotations

from typing import Protocol

from service.engine.spec.adaptive.controller import DraftConfidence, StepContext, StepController, StepOutcome
from service.engine.spec.adaptive.estimates import AcceptanceByPosition, ConfidenceCalibration, DecayedRate
from service.types import MAX_DRAFT_LENGTH, Drafter

PROBE_EVERY = 16  # plain steps in a row (times the pass's requests) before one probe
MAX_PROBE_EVERY = 128  # ... doubling after each rejected probe, up to this
PROBE_LENGTH = 2  # drafts a probe verifies (fewer where the step's limit is lower)
RECHECK_EVERY = 4  # after a plain decision, steps until the positions are priced again (same batch size)
MAX_RECHECK = 16  # ... doubling after each plain decision in a row, up to this
OWN_DECAY = 0.9  # a request's own acceptance: ~10 steps of memory (its text changes)
KIND_PRIOR = 0.5  # a position's acceptance before any request of the kind reached it


class EngineEstimates(Protocol):
    """What the rule reads of the engine's shared estimates (state.AdaptiveState, which makes the rules)."""

    acceptance: dict[tuple[Drafter, bool], AcceptanceByPosition]  # per (drafter, sampled)
    calibration: dict[tuple[Drafter, bool], ConfidenceCalibration]
    lookup_found: dict[bool, DecayedRate]  # per sampled

    def step_prices(self, positions: int, drafter: Drafter, sampled: bool) -> tuple[float, list[float]]: ...

    def first_draft_seconds(self, drafter: Drafter, draft_lag: int = 0) -> float: ...

    def observe_predictions(self, predicted: list[float], accepted: int) -> None: ...


class MoespecRule(StepController):
    wants_confidence = True
    hears_plain_steps = False  # a step without drafts carries no acceptance; plain stretches are plan's

    def __init__(self, state: EngineEstimates, drafter: Drafter, cost_weight: float, sampled: bool = False):
        self.state, self.drafter, self.weight, self.sampled = state, drafter, cost_weight, sampled
        self.own = AcceptanceByPosition(MAX_DRAFT_LENGTH, decay=OWN_DECAY)
        self.own_found = DecayedRate(OWN_DECAY)  # n-gram: its lookups that found a draft
        # what every request of this kind feeds and reads (looked up once: a step asks for them per position)
        self._kind_acceptance = state.acceptance[drafter, sampled]
        self._calibration = state.calibration[drafter, sampled]
        self._kind_found = state.lookup_found[sampled]
        self._costs: list[float] = []  # this step's marginal cost of each position, seconds (unweighted)
        self._first = 0.0  # ... and what drafting at all adds to the first position's
        self._plain = 0.0  # what this step costs this request without drafts: S for one token
        self._rates: list[float] = []  # the conditional acceptance the verified drafts were sent with
        self._walked = (0.0, 1.0)  # the last walk's S_k and T_k: seconds and expected tokens of its positions
        self._plain_run = 0
        self._probing = False  # this step verifies one draft to measure, whatever the estimates say
        self._probe_every = PROBE_EVERY  # plain steps in a row before the next probe
        self._quiet = (0, 0)  # (steps left, batch size) of plain kept without pricing
        self._recheck = RECHECK_EVERY  # the next plain decision's quiet stretch

    def rate(self, i: int) -> float:
        """This request's conditional acceptance of position i, before its draft is seen."""
        return self.own.rate(i, self._kind_acceptance.rate(i, KIND_PRIOR))

    def plan(self, ctx: StepContext, limit: int) -> int:
        left, batch = self._quiet
        if left and batch == ctx.batch_size and limit > 0:
            self._quiet = (left - 1, batch)
            return self._plain_or_probe(batch, limit)
        s = self.state
        # the pass holds this request's last committed token at least
        self._plain, self._costs = s.step_prices(ctx.other_positions + 1, self.drafter, self.sampled)
        if self.drafter is Drafter.NGRAM:  # the walk prices the drafts a lookup finds; then the lookup
            self._first = 0.0
            k = self._keep(limit)
            if k and not self._lookup_pays(s.first_draft_seconds(Drafter.NGRAM)):
                k = 0
        else:
            self._first = s.first_draft_seconds(self.drafter, ctx.draft_lag)
            k = self._keep(limit)
        if k == 0 and limit > 0:
            self._quiet = (self._recheck - 1, ctx.batch_size)
            self._recheck = min(MAX_RECHECK, 2 * self._recheck)
            return self._plain_or_probe(ctx.batch_size, limit)
        self._plain_run, self._probing, self._recheck, self._probe_every = 0, False, RECHECK_EVERY, PROBE_EVERY
        return k

    def _lookup_pays(self, lookup: float) -> bool:
        """An n-gram lookup finds drafts with probability q (this request's rate, shrunk towards its
        kind's); the walk's positions are verified and paid only then (seconds S_k, tokens T_k), the
        lookup L always. Asking lowers this request's seconds per token iff
        (S + L + q (S_k - S)) / (1 + q (T_k - 1)) < S, that is L < q (S (T_k - 1) - (S_k - S)).
        (Priced as if every lookup found drafts, a text where most find none drafted at a loss.)"""
        seconds, tokens = self._walked
        q = self.own_found.rate(self._kind_found.rate(KIND_PRIOR))
        return self.weight * lookup < q * (self._plain * (tokens - 1) - (seconds - self._plain))

    def _plain_or_probe(self, batch_size: int, limit: int) -> int:
        """A step the rule keeps plain, except the probe after `_probe_every` x the pass's requests
        of them in a row."""
        self._plain_run += 1
        self._probing = self._plain_run >= self._probe_every * batch_size
        if not self._probing:
            self._rates = []
            return 0
        self._plain_run, self._quiet, self._recheck = 0, (0, 0), RECHECK_EVERY
        k = min(limit, PROBE_LENGTH)
        self._rates = [self.rate(i) for i in range(k)]
        return k

    def _keep(self, limit: int, rates: list[float] | None = None) -> int:
        """Positions that pay, walked in order: while P_i * S / T exceeds position i's weighted cost,
        S and T growing with each position kept. Position i's conditional acceptance is rates[i], or
        without `rates` this request's `rate(i)` (written out here: the walk runs on every request's
        step, and three calls per position were most of its cost). The kept positions' rates stay
        in `_rates`. No position past the first that does not pay is priced."""
        seconds, tokens, p, weight, costs = self._plain, 1.0, 1.0, self.weight, self._costs
        own, kind = self.own, self._kind_acceptance
        hits, reached, strength = own.accepted, own.reached, own.strength
        kind_hits, kind_reached, kind_strength = kind.accepted, kind.reached, kind.strength
        kind_shrink = kind.strength * KIND_PRIOR
        kept = self._rates = []
        for i in range(limit):
            if rates is None:
                prior = (kind_hits[i] + kind_shrink) / (kind_reached[i] + kind_strength)
                rate = (hits[i] + strength * prior) / (reached[i] + strength)
            else:
                rate = rates[i]
            p *= rate
            cost = weight * (costs[i] + self._first if i == 0 else costs[i])
            if p * seconds <= cost * tokens:
                self._walked = (seconds, tokens)
                return i
            kept.append(rate)
            seconds, tokens = seconds + cost, tokens + p
        self._walked = (seconds, tokens)
        return limit

    def cut(self, confidence: DraftConfidence) -> int:
        rates = [self._calibration.rate(top) for top in confidence.top]
        if self._probing:
            self._rates = rates
            return len(rates)
        return self._keep(len(rates), rates)

    def expected_accepted(self, drafted: int) -> float:
        p, total = 1.0, 0.0
        for rate in self._rates[:drafted]:
            p *= rate
            total += p
        return total

    def observe(self, outcome: StepOutcome) -> None:
        d, a = outcome.drafted, outcome.accepted
        if self._probing:  # a rejected (or empty) probe: the next one waits twice as long
            self._probe_every = PROBE_EVERY if a > 0 else min(MAX_PROBE_EVERY, 2 * self._probe_every)
        if outcome.planned > 0 and self.drafter is Drafter.NGRAM:  # whether the lookup found a draft
            self.own_found.observe(d > 0)
            self._kind_found.observe(d > 0)
        self.own.observe(d, a, self._kind_acceptance)
        reached = min(d, a + 1)  # the positions verification reached
        if outcome.confidence is not None:
            for i, top in enumerate(outcome.confidence.top[:reached]):
                self._calibration.observe(top, i < a)
        if self._rates:
            self.state.observe_predictions(self._rates[:reached], a)
