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
        self.seen = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.seen += 1
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class PassCost:
    """Verify seconds of a pass of n positions: c0 + c1 * n + c2 * U(n) (see the module docstring)."""

    FORGET = 0.995  # a few hundred passes of memory
    PRIOR = 1e4  # the initial inverse-precision: the first passes set the coefficients

    def __init__(self, num_experts: int, top_k: int):
        self.E, self.m = num_experts, top_k
        self.theta = [0.0, 0.0, 0.0]
        self.P = [[self.PRIOR if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.unions: dict[int, Ema] = {}  # n -> mean union per layer seen at n positions
        self.passes = 0

    # -- the union at n positions -----------------------------------------------------------------
    def independent_union(self, n: int) -> float:
        """Expected distinct experts of n positions that each pick m of E at random."""
        return self.E * (1 - (1 - self.m / self.E) ** n)

    def union(self, n: int) -> float:
        """Mean distinct experts per layer at n positions: the ones seen, else the independent
        estimate scaled to the nearest n seen (routing is correlated: real unions are smaller)."""
        if n <= 1:
            return float(min(self.m, self.E)) if n == 1 else 0.0
        seen = self.unions.get(n)
        if seen is not None:
            return seen.value
        if not self.unions:
            return self.independent_union(n)
        nearest = min(self.unions, key=lambda s: (abs(s - n), s))
        ratio = self.unions[nearest].value / self.independent_union(nearest)
        return min(float(self.E), ratio * self.independent_union(n))

    # -- the fit ------------------------------------------------------------------------------------
    def _features(self, n: int, union: float) -> list[float]:
        return [1.0, n / 16, union / self.E]  # scaled to like magnitudes: the fit stays well conditioned

    def observe(self, positions: int, union_per_layer: float, seconds: float) -> None:
        """One verify pass: its positions, mean distinct experts per layer (0 when not counted), seconds."""
        if positions < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        if union_per_layer > 0:
            self.unions.setdefault(positions, Ema(0.1)).update(union_per_layer)
        x = self._features(positions, union_per_layer if union_per_layer > 0 else self.union(positions))
        P, lam = self.P, self.FORGET
        Px = [sum(P[i][j] * x[j] for j in range(3)) for i in range(3)]
        gain_den = lam + sum(x[i] * Px[i] for i in range(3))
        K = [v / gain_den for v in Px]
        error = seconds - sum(t * v for t, v in zip(self.theta, x, strict=True))
        self.theta = [t + k * error for t, k in zip(self.theta, K, strict=True)]
        self.P = [[(P[i][j] - K[i] * Px[j]) / lam for j in range(3)] for i in range(3)]
        self.passes += 1

    def seconds(self, n: int) -> float:
        return sum(t * v for t, v in zip(self.theta, self._features(n, self.union(n)), strict=True))

    def marginal(self, n: int) -> float:
        """Extra verify seconds of position n + 1 in a pass that has n (never below 0: a fit may tilt)."""
        return max(0.0, self.seconds(n + 1) - self.seconds(n))


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
