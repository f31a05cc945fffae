"""What the adaptive controllers learn online from the engine's own passes.

- `PassCost`: the verify pass's seconds as a function of its positions and of the distinct routed
  experts they touch (the batch union): seconds ~ c0 + c1 * n + c2 * U(n), fitted by recursive
  least squares with forgetting (the machine's speed drifts), and U(n), the mean union per layer at n
  positions, from the passes seen. The marginal cost of one more position is then
  c1 + c2 * (U(n + 1) - U(n)): on an MoE target a position that brings new experts costs more than
  one that reuses them, and how many new experts it brings depends on the pass it joins.
- `Ema`: an exponential moving average that knows whether it has seen anything.
- `AcceptanceByPosition`: P(draft i accepted | drafts before it accepted), per position, as decayed
  counts shrunk towards a prior.
- `ConfidenceCalibration`: the same probability as a function of the draft distribution's own
  confidence (its largest probability), in bins, learned from verify outcomes.

All of it runs on the scheduler thread, a few float operations per pass and per step.
"""

from __future__ import annotations

import math


class Ema:
    def __init__(self, alpha: float, initial: float | None = None):
        self.alpha = alpha
        self.value = initial

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class PassCost:
    """Verify seconds of a pass of n positions: c0 + c1 * n + c2 * U(n) (see the module docstring)."""

    FORGET = 0.995  # a few hundred passes of memory
    # Passes between recomputing the marginals: the fit moves over hundreds of passes, and at one
    # request a pass every request asked for them anew (most of the rule's cost per step).
    REPRICE_EVERY = 8
    PRIOR = 1e4  # the initial inverse-precision: the first passes set the coefficients

    def __init__(self, num_experts: int, top_k: int):
        self.E, self.m = num_experts, top_k
        self.theta = [0.0, 0.0, 0.0]
        self.P = [[self.PRIOR if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.unions: dict[int, Ema] = {}  # n -> mean union per layer seen at n positions
        # seen / independent union, over the passes seen: scales the independent estimate where n is unseen
        self.correlation = Ema(0.05)
        self.passes = 0
        self.longest = 0  # the most positions of any pass seen
        self._marginals: dict[int, float] = {}  # n -> marginal(n), kept for REPRICE_EVERY passes

    # -- the union at n positions -----------------------------------------------------------------
    def independent_union(self, n: int) -> float:
        """Expected distinct experts of n positions that each pick m of E at random."""
        return self.E * (1 - (1 - self.m / self.E) ** n)

    def union(self, n: int) -> float:
        """Mean distinct experts per layer at n positions: the ones seen, else the independent
        estimate scaled as the unions seen compare with theirs (routing is correlated: real unions
        are smaller)."""
        if n <= 1:
            return float(min(self.m, self.E)) if n == 1 else 0.0
        seen = self.unions.get(n)
        if seen is not None:
            return seen.value
        return min(float(self.E), self.correlation.get(1.0) * self.independent_union(n))

    # -- the fit ------------------------------------------------------------------------------------
    def observe(self, positions: int, union_per_layer: float, seconds: float) -> None:
        """One verify pass: its positions, mean distinct experts per layer (0 when not counted), seconds."""
        if positions < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        if union_per_layer > 0:
            self.unions.setdefault(positions, Ema(0.1)).update(union_per_layer)
            if positions > 1:
                self.correlation.update(union_per_layer / self.independent_union(positions))
        u = union_per_layer if union_per_layer > 0 else self.union(positions)
        # Features scaled to like magnitudes, so the fit stays well conditioned; unrolled 3 x 3
        # recursive least squares (a pass pays this, so it is kept to plain float arithmetic).
        x0, x1, x2 = 1.0, positions / 16, u / self.E
        (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = self.P
        a0, a1, a2 = p00 * x0 + p01 * x1 + p02 * x2, p10 * x0 + p11 * x1 + p12 * x2, p20 * x0 + p21 * x1 + p22 * x2
        lam = self.FORGET
        den = lam + x0 * a0 + x1 * a1 + x2 * a2
        k0, k1, k2 = a0 / den, a1 / den, a2 / den
        t0, t1, t2 = self.theta
        error = seconds - (t0 * x0 + t1 * x1 + t2 * x2)
        self.theta = [t0 + k0 * error, t1 + k1 * error, t2 + k2 * error]
        # P' = (P - K a^T) / lam, with a = P x (P symmetric)
        P = [[(p00 - k0 * a0) / lam, (p01 - k0 * a1) / lam, (p02 - k0 * a2) / lam],
             [(p10 - k1 * a0) / lam, (p11 - k1 * a1) / lam, (p12 - k1 * a2) / lam],
             [(p20 - k2 * a0) / lam, (p21 - k2 * a1) / lam, (p22 - k2 * a2) / lam]]
        # Forgetting inflates P along directions the passes do not vary (a plain-only load repeats
        # one x): bounded at the prior's trace, it can never wind up to overflow.
        trace = P[0][0] + P[1][1] + P[2][2]
        if not math.isfinite(trace) or trace <= 0:
            P = [[self.PRIOR if i == j else 0.0 for j in range(3)] for i in range(3)]
        elif trace > 3 * self.PRIOR:
            P = [[v * 3 * self.PRIOR / trace for v in row] for row in P]
        self.P = P
        self.passes += 1
        if positions > self.longest or self.passes % self.REPRICE_EVERY == 0:
            self._marginals.clear()
        self.longest = max(self.longest, positions)

    def seconds(self, n: int) -> float:
        t0, t1, t2 = self.theta
        return t0 + t1 * n / 16 + t2 * self.union(n) / self.E

    def marginal(self, n: int) -> float:
        """Extra seconds of position n + 1 in a pass that has n (never below 0: a fit may tilt).
        Where no pass was ever that long, the fit extrapolates along a direction the data may not
        pin down (passes of one or two positions cannot tell c1 from c2, and a tilted fit made
        eight-token drafts look free to sampled requests): it is never cheaper there than the
        last position the passes seen cover, and with no pass of two positions yet it costs a
        whole one-position pass. Cached for REPRICE_EVERY passes (and until a pass longer than any
        before): every request asks for the same few n."""
        cached = self._marginals.get(n)
        if cached is None:
            cached = max(0.0, self.seconds(n + 1) - self.seconds(n))
            if self.longest < 2:
                cached = max(cached, self.seconds(1))
            elif n + 1 > self.longest:
                covered = self.longest - 1
                cached = max(cached, self.seconds(covered + 1) - self.seconds(covered))
            self._marginals[n] = cached
        return cached


class AcceptanceByPosition:
    """P(draft i accepted | every draft before it accepted) for i < length: decayed counts per
    position, shrunk towards `prior(i)` with the weight of `strength` observations."""

    def __init__(self, length: int, decay: float, strength: float = 4.0):
        self.decay, self.strength = decay, strength
        self.accepted = [0.0] * length
        self.reached = [0.0] * length

    def rate(self, i: int, prior: float) -> float:
        return (self.accepted[i] + self.strength * prior) / (self.reached[i] + self.strength)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted`: positions 0..accepted
        were reached (the one after the last accepted was rejected, if there is one)."""
        for i in range(min(drafted, accepted + 1)):
            self.reached[i] = self.decay * self.reached[i] + 1
            self.accepted[i] = self.decay * self.accepted[i] + (1.0 if i < accepted else 0.0)


class ConfidenceCalibration:
    """P(a reached draft is accepted) as a function of the draft distribution's largest probability,
    in `bins` equal bins over [0, 1]; a bin starts at its centre and follows its verify outcomes."""

    def __init__(self, bins: int = 10, alpha: float = 0.05):
        self.bins = bins
        self.rates = [Ema(alpha, (b + 0.5) / bins) for b in range(bins)]

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def rate(self, confidence: float) -> float:
        return self.rates[self._bin(confidence)].value

    def observe(self, confidence: float, accepted: bool) -> None:
        self.rates[self._bin(confidence)].update(1.0 if accepted else 0.0)
