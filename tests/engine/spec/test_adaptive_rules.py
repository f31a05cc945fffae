"""The adaptive controllers on scripted inputs: moespec's rule stops at the optimum of known
acceptance and cost curves, its estimates converge on synthetic passes and drafters, and each
baseline reproduces its published rule step by step."""

from __future__ import annotations

import random

import pytest

from service.engine.spec.adaptive.baselines import CascadeUtility, SglangEmaTiers, SglangTier, TransformersHeuristic
from service.engine.spec.adaptive.controller import DraftConfidence, StepContext, StepOutcome
from service.engine.spec.adaptive.estimates import AcceptanceByPosition, ConfidenceCalibration, PassCost
from service.engine.spec.adaptive.rule import MAX_PROBE_EVERY, PROBE_EVERY, PROBE_LENGTH, MoespecRule
from service.engine.spec.adaptive.state import AdaptiveState
from service.types import Drafter

E, M = 64, 4  # routed experts and experts per token of the synthetic target


def true_union(n: int) -> float:
    """A correlated routing: fewer distinct experts than independent picks would give."""
    return E * (1 - (1 - M / E) ** (0.6 * n + 0.4))


def true_seconds(n: int) -> float:
    """A synthetic verify pass: fixed cost, per position, per distinct expert."""
    return 4e-4 + 2e-6 * n + 1.5e-5 * true_union(n)


def fitted_state(max_positions: int = 40, passes: int = 400, noise: float = 0.02, seed: int = 0) -> AdaptiveState:
    state = AdaptiveState(E, M, plain_step_seconds=true_seconds(1))
    rng = random.Random(seed)
    for _ in range(passes):
        n = rng.randint(1, max_positions)
        state.observe_pass(n, true_union(n), true_seconds(n) * (1 + rng.uniform(-noise, noise)))
    return state


def brute_force_length(rates: list[float], costs: list[float], base_seconds: float, base_tokens: float) -> int:
    """The k in [0, len(rates)] with the lowest expected seconds per committed token of the pass."""
    best, best_cost, p, seconds, tokens = 0, base_seconds / base_tokens, 1.0, base_seconds, base_tokens
    for k, (rate, cost) in enumerate(zip(rates, costs, strict=True), start=1):
        p *= rate
        seconds, tokens = seconds + cost, tokens + p
        if seconds / tokens < best_cost - 1e-15:
            best, best_cost = k, seconds / tokens
    return best


# ------------------------------------------------------------------------------- the pass cost
def test_the_pass_cost_fit_recovers_the_marginal_cost_of_one_more_position():
    state = fitted_state()
    for n in (1, 4, 12, 30):
        want = true_seconds(n + 1) - true_seconds(n)
        assert state.cost.marginal(n) == pytest.approx(want, rel=0.1), n
    # Union-aware: a position joining a small pass brings more new experts than one joining a big pass.
    assert state.cost.marginal(1) > 2 * state.cost.marginal(30)


def test_the_pass_cost_fit_follows_a_machine_that_slows_down():
    """Shared machines drift: after the passes get 1.5x dearer, the fit forgets the old speed within
    a few of its memories (FORGET) instead of averaging the two."""
    state = fitted_state(passes=600)
    rng = random.Random(1)
    for _ in range(1500):
        n = rng.randint(1, 40)
        state.observe_pass(n, true_union(n), 1.5 * true_seconds(n))
    for n in (1, 4, 12):
        assert state.cost.seconds(n) == pytest.approx(1.5 * true_seconds(n), rel=0.03), n
        assert state.cost.marginal(n) == pytest.approx(1.5 * (true_seconds(n + 1) - true_seconds(n)), rel=0.1), n


def test_disturbed_passes_do_not_feed_the_pass_cost_fit():
    """A pass right after a prefill or after requests finished pays for what ran around it: at 16
    clients such passes of 15 positions cost more than the steady passes of 16, and fitted they
    made extra positions look free. The fit keeps to the steady passes."""
    state = fitted_state()
    before = [state.cost.marginal(n) for n in (1, 8, 16)], state.cost.seconds(16)
    rng = random.Random(2)
    for _ in range(400):
        n = rng.randint(12, 16)
        state.observe_pass(n, true_union(n), 1.6 * true_seconds(n) * (17 - n), disturbed=True)
    assert ([state.cost.marginal(n) for n in (1, 8, 16)], state.cost.seconds(16)) == before


def test_beyond_the_longest_pass_seen_a_position_costs_at_least_the_last_one_covered():
    """Passes of one and two positions only (a plain load and its probes) pin down one increment;
    the fit cannot tell the per-position from the per-expert cost, so its extrapolation is bounded
    by that increment instead of trusted. Before any pass, a position costs a whole plain step."""
    state = AdaptiveState(E, M, plain_step_seconds=true_seconds(1))
    assert state.marginals(1, 8) == [true_seconds(1)] * 8
    rng = random.Random(3)
    for _ in range(300):
        n = rng.choice((1, 2))
        state.observe_pass(n, true_union(n), true_seconds(n) * (1 + rng.uniform(-0.02, 0.02)))
    covered = true_seconds(2) - true_seconds(1)
    first, *beyond = state.marginals(1, 8)
    assert first == pytest.approx(covered, rel=0.2)
    # Fitted from those passes alone, a position joining a longer pass brings fewer new experts and
    # would look cheaper than the one the passes measured; bounded, none is.
    assert all(m >= first for m in beyond)
    assert beyond == [state.marginals(n, 1)[0] for n in range(2, 9)]  # one walk prices each as alone


def test_the_union_estimate_scales_the_independent_one_to_the_unions_seen():
    cost = PassCost(E, M)
    for n in (2, 8):
        cost.observe(n, true_union(n), true_seconds(n))
    assert cost.union(1) == M and cost.union(8) == pytest.approx(true_union(8))
    # unseen: the independent estimate scaled as the unions seen compare with theirs
    assert cost.union(9) == pytest.approx(true_union(9), rel=0.15)
    assert abs(cost.union(9) - true_union(9)) < abs(cost.independent_union(9) - true_union(9)) / 2


# ------------------------------------------------------------------------------- moespec's rule
def with_known_acceptance(rule: MoespecRule, rates: list[float]) -> MoespecRule:
    """A drafter of known conditional acceptance: the request's own estimate made of so many
    outcomes at those rates that its prior no longer counts."""
    seen = 1e12
    rule.own.reached[:] = [seen] * len(rates)
    rule.own.accepted[:] = [r * seen for r in rates]
    assert [rule.rate(i) for i in range(len(rates))] == pytest.approx(rates, abs=1e-9)
    return rule


def rule_with_rates(state: AdaptiveState, rates: list[float], weight: float = 1.0) -> MoespecRule:
    return with_known_acceptance(MoespecRule(state, Drafter.NGRAM, weight), rates)


CURVES = {
    "flat high": [0.95] * 8,
    "flat low": [0.1] * 8,
    "falling": [0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05],
    "one good draft": [0.9, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
}


@pytest.mark.parametrize("curve", CURVES)
@pytest.mark.parametrize("others", [0, 24], ids=["alone", "in a batch"])
def test_the_rule_stops_at_the_optimum_of_known_acceptance_and_cost_curves(curve, others):
    """The length that gives this request the fewest seconds per token: a plain step costs it its
    position's share of the pass."""
    state = fitted_state()
    rates = CURVES[curve]
    rule = rule_with_rates(state, rates)
    ctx = StepContext(batch_size=1 if others == 0 else 8, other_positions=others)
    k = rule.plan(ctx, 8)
    n = ctx.other_positions + 1
    costs = [state.cost.marginal(n + i) for i in range(8)]
    assert k == brute_force_length(rates, costs, state.cost.seconds(n) / n, 1.0)


def test_the_rule_drafts_all_with_certain_drafts_and_nothing_with_hopeless_ones():
    state = fitted_state()
    alone = StepContext(1, 0)
    assert rule_with_rates(state, [1.0] * 8).plan(alone, 8) == 8
    assert rule_with_rates(state, [0.01] * 8).plan(alone, 8) == 0
    assert rule_with_rates(state, [1.0] * 8).plan(alone, 3) == 3  # never past the limit


def test_a_higher_cost_weight_drafts_less():
    state = fitted_state()
    rates = CURVES["falling"]
    ks = [rule_with_rates(state, rates, w).plan(StepContext(1, 0), 8) for w in (0.25, 1.0, 4.0)]
    assert ks[0] > ks[1] > ks[2], ks


def test_in_a_full_compute_bound_pass_only_what_this_request_pays_prices_its_drafts():
    """A pass whose seconds grow by a position's cost at every position (compute-bound), beside ten
    sampled requests whose acceptance costs more than the pass itself. Alone, a draft accepted at
    0.6 saves most of a step and is drafted; in the full pass a plain step costs this request about
    one position, so the same draft costs more than it brings, however dear the pass's other
    requests make its seconds per token."""
    def seconds(n: int) -> float:
        return 4e-4 + 6e-5 * n

    state = AdaptiveState(E, M, plain_step_seconds=seconds(1))
    rng = random.Random(5)
    for _ in range(400):
        n = rng.randint(1, 40)
        sampling = 1.5e-3 if n >= 10 else 0.0  # the others' acceptance, beside the pass
        state.observe_pass(n, true_union(n), seconds(n) + sampling, sampling_seconds=sampling,
                           sampled_rows=10 if sampling else 0)
    rates = [0.6] * 8
    assert rule_with_rates(state, rates).plan(StepContext(1, 0), 8) > 0
    assert rule_with_rates(state, rates).plan(StepContext(16, 15), 8) == 0
    assert rule_with_rates(state, [0.99] * 8).plan(StepContext(16, 15), 8) > 0  # near-certain drafts still pay


def test_a_new_request_starts_from_what_requests_of_its_own_kind_accepted():
    """Greedy requests accepted n-gram drafts at 0.9, sampled ones at 0.02: a new greedy request
    drafts, a new sampled one does not (with one engine-wide prior both would start from ~0.5)."""
    state = fitted_state()
    for sampled, rate in ((False, 0.9), (True, 0.02)):
        rng = random.Random(int(sampled))
        veteran = MoespecRule(state, Drafter.NGRAM, 1.0, sampled=sampled)
        for _ in range(3000):
            accepted = next((i for i in range(4) if rng.random() > rate), 4)
            veteran.observe(StepOutcome(drafted=4, accepted=accepted, seconds=1e-3, committed=accepted + 1,
                                        confidence=None))
    greedy = MoespecRule(state, Drafter.NGRAM, 1.0, sampled=False)
    sampled = MoespecRule(state, Drafter.NGRAM, 1.0, sampled=True)
    assert greedy.rate(0) == pytest.approx(0.9, abs=0.05) and sampled.rate(0) == pytest.approx(0.02, abs=0.03)
    assert greedy.plan(StepContext(1, 0), 8) > 0
    assert sampled.plan(StepContext(1, 0), 8) == 0


def test_a_sampled_request_pays_its_own_acceptance_of_each_row():
    """Sampled rows cost their target probabilities and accept test beside the pass: where that is
    dear, a sampled request drafts less than a greedy one with the same acceptance."""
    state = fitted_state()
    state.observe_pass(1, true_union(1), true_seconds(1) + 4e-4, sampling_seconds=4e-4, sampled_rows=1)
    assert state.row_seconds(sampled=True) == pytest.approx(4e-4) and state.row_seconds(sampled=False) == 0.0
    rates = [0.7] * 8
    greedy, sampled = (rule_with_rates(state, rates) for _ in range(2))
    sampled.sampled = True
    assert greedy.plan(StepContext(1, 0), 8) > sampled.plan(StepContext(1, 0), 8)


def test_the_model_drafter_is_priced_per_position_it_feeds_and_its_catch_up_on_the_first_draft():
    """A step's first draft round feeds every token the draft cache lacks: a draft after a plain
    stretch pays for all of them, one after a drafting step for its few committed tokens. Priced per
    round instead, the catch-ups made every draft look several positions dear."""
    state = fitted_state()
    state.observe_draft_positions(positions=20, seconds=20 * 3e-5)  # e.g. a catch-up of 17, then 3 more rounds
    assert state.draft_seconds(Drafter.MODEL) == pytest.approx(3e-5)
    assert state.first_draft_seconds(Drafter.MODEL, draft_lag=1) == 0.0  # the token every first round feeds
    assert state.first_draft_seconds(Drafter.MODEL, draft_lag=41) == pytest.approx(40 * 3e-5)
    after_drafting, after_plain = (with_known_acceptance(MoespecRule(state, Drafter.MODEL, 1.0), [0.9] * 8)
                                   for _ in range(2))
    assert after_drafting.plan(StepContext(1, 0, draft_lag=2), 8) > 0
    assert after_plain.plan(StepContext(1, 0, draft_lag=400), 8) == 0


def test_after_sixteen_plain_steps_the_rule_probes_a_short_window_and_keeps_it_whatever_the_confidence():
    """PROBE_LENGTH drafts, not one: probes of one draft showed the pass-cost fit windows of one and
    two positions only, from which it priced every position at a whole step, and a greedy request
    whose drafts paid never drafted again."""
    state = fitted_state()
    rule = rule_with_rates(state, [0.01] * 8)
    ks = [rule.plan(StepContext(1, 0), 8) for _ in range(2 * PROBE_EVERY - 1)]
    assert ks.count(PROBE_LENGTH) == 1 and ks[PROBE_EVERY - 1] == PROBE_LENGTH and set(ks) == {0, PROBE_LENGTH}
    assert rule.plan(StepContext(1, 0), 8) == PROBE_LENGTH
    assert rule.cut(DraftConfidence((0.01,) * PROBE_LENGTH, (0.01,) * PROBE_LENGTH)) == PROBE_LENGTH
    assert [rule.plan(StepContext(1, 0), 1) for _ in range(PROBE_EVERY)][-1] == 1  # never past the step's limit


def test_in_a_full_pass_each_request_probes_as_many_times_less_often_as_the_pass_has_requests():
    """Every request's probes feed its kind's engine-wide estimates: the pass, not each request,
    carries one probe per PROBE_EVERY passes."""
    state = fitted_state()
    rule = rule_with_rates(state, [0.01] * 8)
    ks = [rule.plan(StepContext(16, 15), 8) for _ in range(16 * PROBE_EVERY)]
    assert ks.count(PROBE_LENGTH) == 1 and ks[-1] == PROBE_LENGTH


def test_rejected_probes_space_out_and_an_accepted_one_starts_over():
    state = fitted_state()
    rule = rule_with_rates(state, [0.01] * 8)

    def next_probe(accepted: int) -> int:
        """Plain steps until the rule probes; the probe's draft is then `accepted` or rejected."""
        for step in range(1, 1000):
            k = rule.plan(StepContext(1, 0), 8)
            rule.observe(StepOutcome(drafted=k, accepted=min(k, accepted), seconds=1e-3, committed=1,
                                     confidence=None))
            if k:
                return step
        raise AssertionError("no probe")

    assert [next_probe(0) for _ in range(5)] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY,
                                                 MAX_PROBE_EVERY]
    next_probe(1)  # accepted (still after MAX_PROBE_EVERY): the next comes after PROBE_EVERY again
    assert next_probe(0) == PROBE_EVERY


def test_the_cut_keeps_the_prefix_the_calibrated_confidences_pay_for():
    state = fitted_state()
    calibration = state.calibration[Drafter.NGRAM, False]
    for b in range(calibration.bins):  # a known calibration: acceptance = the bin's upper edge
        calibration.rates[b].value = (b + 1) / calibration.bins
    rule = rule_with_rates(state, [0.99] * 8)
    assert rule.plan(StepContext(1, 0), 8) == 8
    confidence = DraftConfidence(token=(0.5,) * 8, top=(0.99, 0.99, 0.99, 0.05, 0.99, 0.99, 0.99, 0.99))
    k = rule.cut(confidence)
    assert k == 3  # the fourth draft's distribution was unsure: it and everything after go


# ------------------------------------------------------------------------------- calibration
def test_acceptance_by_position_converges_on_a_drafter_of_known_acceptance():
    rng, truth = random.Random(1), [0.9, 0.7, 0.5, 0.3]
    own, kind = AcceptanceByPosition(4, decay=0.999), AcceptanceByPosition(4, decay=0.999)
    for _ in range(5000):
        accepted = 0
        while accepted < 4 and rng.random() < truth[accepted]:
            accepted += 1
        own.observe(4, accepted, kind)  # a request's own estimate and its kind's hear it together
    for acc in (own, kind):
        assert [acc.rate(i, 0.5) for i in range(4)] == pytest.approx(truth, abs=0.04)


def test_confidence_calibration_converges_on_a_drafter_of_known_calibration():
    rng, cal = random.Random(2), ConfidenceCalibration(alpha=0.01)
    for _ in range(40000):
        c = rng.random()
        cal.observe(c, rng.random() < c * c)  # accepted with probability confidence squared
    for b in range(cal.bins):
        lo, hi = b / cal.bins, (b + 1) / cal.bins
        assert cal.rate((lo + hi) / 2) == pytest.approx((hi ** 3 - lo ** 3) / 3 / (hi - lo), abs=0.06), b


def calibration_error_after(rule: MoespecRule, state: AdaptiveState, acceptance: float, steps: int = 3000) -> float:
    rng = random.Random(3)
    for _ in range(steps):
        k = rule.plan(StepContext(1, 0), 8)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        rule.observe(StepOutcome(k, accepted, 1e-3, accepted + 1, None))
    return state.calibration_error


def drafting_steps_with_a_lookup_that_finds(rule: MoespecRule, every: int, steps: int = 400) -> list[int]:
    """Each step's plan, where one lookup of `every` finds the drafts asked for (all of them
    accepted) and the others find nothing; the rule hears a step as the scheduler tells it (one
    that asked for drafts, found or not)."""
    planned, lookups = [], 0
    for _ in range(steps):
        k = rule.plan(StepContext(1, 0), 8)
        planned.append(k)
        if k:
            found = k if lookups % every == 0 else 0
            lookups += 1
            rule.observe(StepOutcome(found, found, 1e-3, found + 1, None, planned=k))
    return planned


def test_a_lookup_that_seldom_finds_a_draft_is_not_asked_for():
    """Found drafts are always accepted, and a lookup costs two plain steps. Finding drafts in one
    lookup of ten, the eight tokens found do not pay for ten lookups, so the rule stops asking (but
    for its probes); finding them every time, they do. Priced as if every lookup found its drafts,
    it kept asking."""
    def rule() -> MoespecRule:
        state = fitted_state()
        state.observe_lookup(2 * state.plain_step_share(1, sampled=False))
        return with_known_acceptance(MoespecRule(state, Drafter.NGRAM, 1.0), [1.0] * 8)

    seldom = drafting_steps_with_a_lookup_that_finds(rule(), every=10)
    assert sum(k > 0 for k in seldom[-200:]) <= 200 / PROBE_EVERY + 1
    always = drafting_steps_with_a_lookup_that_finds(rule(), every=1)
    assert sum(k > 0 for k in always[-200:]) == 200


def test_the_rules_calibration_error_goes_to_zero_on_a_stationary_drafter():
    state = fitted_state()
    rule = MoespecRule(state, Drafter.NGRAM, 0.05)  # cheap costs: it drafts and so keeps learning
    assert calibration_error_after(rule, state, 0.6) < 0.05
    assert rule.rate(0) == pytest.approx(0.6, abs=0.15)


class FrozenRule(MoespecRule):
    """A rule whose estimates never learn: it only reports its predictions."""

    def observe(self, outcome: StepOutcome) -> None:
        reached = min(outcome.drafted, outcome.accepted + 1)
        self.state.observe_predictions(self._rates[:reached], outcome.accepted)


def test_the_calibration_error_shows_a_rule_that_does_not_learn():
    """Negative control: estimates frozen at 0.9 against a drafter accepted 60% of the time."""
    state = fitted_state()
    frozen = with_known_acceptance(FrozenRule(state, Drafter.NGRAM, 0.05), [0.9] * 8)
    assert calibration_error_after(frozen, state, 0.6) > 0.2


# ------------------------------------------------------------------------------- SGLang
def test_sglang_tiers_are_cut_to_the_policy_and_routed_by_batch_size():
    c = SglangEmaTiers(max_length=4)
    assert c.tier(1).candidates == [1, 3] and c.tier(7).candidates == [1, 3]
    assert c.tier(8).candidates == [0, 1, 3] and c.tier(40).candidates == [0, 1] and c.tier(64).candidates == [0]
    assert c.tier(1).steps == 3  # 4 is no candidate: SGLang starts at the middle one (index len // 2)


def test_sglang_switches_tier_after_warm_up_every_fifth_batch_and_follows_the_ema():
    tier = SglangTier((1, 3, 5, 7), initial=7, down_hysteresis=-0.25)
    assert tier.ema == 6.0
    steps = []
    for _ in range(20):
        tier.update([1, 1])
        steps.append(tier.steps)
    # EMA = 1 + 5 * 0.8^n; nothing moves before batch 15 (10 warm-up, then every 5th).
    assert steps[:14] == [7] * 14
    assert tier.ema == pytest.approx(1 + 5 * 0.8 ** 20)
    assert steps[14] == 3  # EMA 1.18: below 4.25 and 2.25 (down), above 0.25: stops at 3
    assert steps[19] == 3


def test_sglang_hysteresis_holds_a_tier_the_ema_has_just_crossed():
    tier = SglangTier((1, 3, 5, 7), initial=3, down_hysteresis=-0.25)
    for ema, want in [(0.4, 3), (0.2, 1)]:  # without the -0.25 hysteresis 0.4 <= 0.5 would drop to 1
        tier.steps, tier.ema = 3, ema
        tier._decide()
        assert tier.steps == want, ema
    tier.steps, tier.ema = 3, 2.6  # above 3 - 0.5: up one candidate at a time while the EMA allows
    tier._decide()
    assert tier.steps == 5
    zero = SglangTier((0, 1, 3), initial=0, down_hysteresis=0.0)
    zero.ema = -1.0
    zero._decide()
    assert zero.steps == 1 and zero.ema == 0.0  # a probe from 0, its EMA restarted


def test_sglang_controller_hears_the_pass_once_through_end_pass():
    c = SglangEmaTiers(max_length=7)
    for _ in range(15):
        for accepted in (0, 0):
            c.observe(StepOutcome(7, accepted, 1e-3, accepted + 1, None))
        c.end_pass(2)
    assert c.tier(2).batches == 15 and c.tier(2).steps < 7


# ------------------------------------------------------------------------------- transformers
def test_transformers_heuristic_adds_two_after_a_full_window_and_takes_one_otherwise():
    c = TransformersHeuristic(max_length=8)
    ctx, lengths = StepContext(1, 0), []
    for accepted_all in (False, False, True, False, False, False, False, False, False, False, True):
        k = c.plan(ctx, 8)
        lengths.append(k)
        c.observe(StepOutcome(k, k if accepted_all else 0, 1e-3, 1, None))
    assert lengths == [8, 7, 6, 8, 7, 6, 5, 4, 3, 2, 1]
    assert c.plan(ctx, 8) == 3 and c.plan(ctx, 2) == 2


def test_transformers_confidence_stop_keeps_the_draft_that_tripped_it():
    c = TransformersHeuristic(max_length=8)
    assert c.cut(DraftConfidence(token=(0.9, 0.35, 0.8, 0.9), top=(0.9,) * 4)) == 2
    assert c.cut(DraftConfidence(token=(0.9, 0.5, 0.8), top=(0.9,) * 3)) == 3


# ------------------------------------------------------------------------------- Cascade
def run_cascade(c: CascadeUtility, rate: dict[int, float], steps: int) -> list[int]:
    """Scripted outcomes: a step at length k commits 1 + k/2 tokens and takes (1 + k/2) / rate[k] s."""
    ks = []
    for _ in range(steps):
        k = c.plan(StepContext(1, 0), 8)
        ks.append(k)
        tokens = 1 + k // 2
        c.observe(StepOutcome(k, k // 2, tokens / rate[k], tokens, None))
    return ks


def test_cascade_tests_each_length_then_sets_the_best_and_tests_again():
    c = CascadeUtility(max_length=8)
    ks = run_cascade(c, {0: 100.0, 1: 105.0, 4: 130.0, 8: 120.0}, 12 + 32 + 12)
    assert ks[:12] == [0, 0, 0, 1, 1, 1, 4, 4, 4, 8, 8, 8]
    assert c.utility(4) == pytest.approx(1.3)
    assert ks[12:44] == [4] * 32 and ks[44:] == ks[:12]


def test_cascade_turns_speculation_off_when_no_length_reaches_utility_one():
    c = CascadeUtility(max_length=8)
    ks = run_cascade(c, {0: 100.0, 1: 90.0, 4: 80.0, 8: 70.0}, 12 + 32)
    assert ks[12:] == [0] * 32
