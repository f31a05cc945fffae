"""What the adaptive controllers learn online from the engine's own passes.

- `PassCost`: the verify pass's seconds as a function of its positions and of the distinct routed
  experts they touch (the batch union): seconds ~ c0 + c1 * n + c2 * U(n), fitted by least squares
  with forgetting (the machine's speed drifts), and U(n), the mean union per layer at n
  positions, from the passes seen. The marginal cost of one more position is then
  c1 + c2 * (U(n + 1) - U(n)): on an MoE target a position that brings new experts costs more than
  one that reuses them, and how many new experts it brings depends on the pass it joins.
- `Ema`: an exponential moving average that knows whether it has seen anything.
- `AcceptanceByPosition`: P(draft i accepted | drafts before it accepted), per position, as decayed
  counts shrunk towards a prior.
- `DecayedRate`: the same for a single event (an n-gram lookup finding drafts).
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
    # Passes between solving the fit anew (and so repricing: `version`): the fit moves over hundreds
    # of passes, and at one request a pass every request asked for the prices anew (most of the rule's
    # cost per step; every 16 passes, the solve and the prices were still a tenth of it).
    REPRICE_EVERY = 32
    UNION_ALPHA = 0.1  # the per-size mean unions: ~10 passes of memory
    RIDGE = 1e-4  # on the coefficients of the scaled features: a direction no pass varies stays near 0

    def __init__(self, num_experts: int, top_k: int):
        self.E, self.m = num_experts, top_k
        self.theta = (0.0, 0.0, 0.0)
        # The fit's sufficient statistics, weighted least squares with forgetting: sum w x x^T (its six
        # distinct entries) and sum w x y, over x = (1, n / 16, U / E). Each pass adds its terms with a
        # weight that grows by 1 / FORGET a pass instead of decaying every term already there (the
        # ratio is the same; solving divides it out): a pass costs a few additions, not the 3 x 3
        # recursive least-squares update it used to.
        self._xx = [0.0] * 6  # 00, 01, 02, 11, 12, 22
        self._xy = [0.0] * 3
        self._weight = 1.0  # the next pass's weight
        self.unions: dict[int, float] = {}  # n -> mean union per layer seen at n positions (an EMA)
        # seen / independent union, over the sizes seen (at each solve): scales the independent
        # estimate where n is unseen
        self.correlation = 1.0
        self.passes = 0
        self.longest = 0  # the most positions of any pass seen
        self.version = 0  # counts the solves: what was priced from an older one is stale

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
            return seen
        return min(float(self.E), self.correlation * self.independent_union(n))

    # -- the fit ------------------------------------------------------------------------------------
    def observe(self, positions: int, union_per_layer: float, seconds: float) -> None:
        """One verify pass: its positions, mean distinct experts per layer (0 when not counted), seconds."""
        if not 0 < seconds < math.inf or positions < 1:  # (NaN fails the comparison too)
            return
        if union_per_layer > 0:
            seen = self.unions.get(positions, union_per_layer)
            self.unions[positions] = seen + self.UNION_ALPHA * (union_per_layer - seen)
            u = union_per_layer
        else:
            u = self.union(positions)
        w = self._weight
        x1, x2 = positions / 16, u / self.E  # features scaled to like magnitudes: a well-conditioned solve
        wx1, wx2 = w * x1, w * x2
        xx, xy = self._xx, self._xy
        xx[0] += w
        xx[1] += wx1
        xx[2] += wx2
        xx[3] += wx1 * x1
        xx[4] += wx1 * x2
        xx[5] += wx2 * x2
        xy[0] += w * seconds
        xy[1] += wx1 * seconds
        xy[2] += wx2 * seconds
        self._weight = w / self.FORGET
        if self._weight > 1e150:  # rescale long before overflow (after ~70,000 passes)
            self._rescale(1 / self._weight)
        self.passes += 1
        if positions > self.longest:
            self.longest = positions
            self._resolve()
        elif self.passes % self.REPRICE_EVERY == 0:
            self._resolve()

    def _resolve(self) -> None:
        self._correlate()
        self._solve()
        self.version += 1

    def _rescale(self, factor: float) -> None:
        self._xx = [v * factor for v in self._xx]
        self._xy = [v * factor for v in self._xy]
        self._weight *= factor

    def _correlate(self) -> None:
        """The unions seen against the independent estimate, averaged over the sizes seen beyond one."""
        ratios = [u / self.independent_union(n) for n, u in self.unions.items() if n > 1]
        if ratios:
            self.correlation = sum(ratios) / len(ratios)

    def _solve(self) -> None:
        """theta = (X^T W X / scale + RIDGE) ^ -1 X^T W y / scale, scale the newest pass's weight (so
        that the ridge weighs against the passes' forgetting-weighted count, as it would with each
        term decayed), by Cramer's rule on the 3 x 3 system."""
        scale = self.FORGET / self._weight
        a00, a01, a02, a11, a12, a22 = (v * scale for v in self._xx)
        b0, b1, b2 = (v * scale for v in self._xy)
        a00, a11, a22 = a00 + self.RIDGE, a11 + self.RIDGE, a22 + self.RIDGE
        c00, c01, c02 = a11 * a22 - a12 * a12, a02 * a12 - a01 * a22, a01 * a12 - a02 * a11
        c11, c12, c22 = a00 * a22 - a02 * a02, a01 * a02 - a00 * a12, a00 * a11 - a01 * a01
        det = a00 * c00 + a01 * c01 + a02 * c02
        if det > 0 and math.isfinite(det):
            self.theta = ((c00 * b0 + c01 * b1 + c02 * b2) / det,
                          (c01 * b0 + c11 * b1 + c12 * b2) / det,
                          (c02 * b0 + c12 * b1 + c22 * b2) / det)

    def seconds(self, n: int) -> float:
        t0, t1, t2 = self.theta
        return t0 + t1 * n / 16 + t2 * self.union(n) / self.E

    def marginal(self, n: int) -> float:
        """Extra seconds of position n + 1 in a pass that has n: `marginals(n, 1)`."""
        return self.marginals(n, 1)[0]

    def marginals(self, n: int, count: int) -> list[float]:
        """Extra seconds of positions n + 1 ... n + count in a pass that has n, each over the one before
        (never below 0: a fit may tilt). Where no pass was ever that long, the fit extrapolates along a
        direction the data may not pin down (passes of one or two positions cannot tell c1 from c2,
        and a tilted fit made eight-token drafts look free to sampled requests): a position there is
        never cheaper than the last position the passes seen cover, and with no pass of two
        positions yet it costs a whole one-position pass. (One walk over the sizes: the prices of
        every position are recomputed at each solve.)"""
        seconds = [self.seconds(i) for i in range(n, n + count + 1)]
        if self.longest < 2:
            beyond, covered = self.seconds(1), 0
        else:
            covered = self.longest  # positions up to this one are covered by a pass seen
            beyond = self.seconds(covered) - self.seconds(covered - 1)
        return [max(0.0, seconds[i + 1] - seconds[i], beyond if n + i + 1 > covered else 0.0)
                for i in range(count)]


class AcceptanceByPosition:
    """P(draft i accepted | every draft before it accepted) for i < length: decayed counts per
    position, shrunk towards `prior(i)` with the weight of `strength` observations."""

    def __init__(self, length: int, decay: float, strength: float = 4.0):
        self.decay, self.strength = decay, strength
        self.accepted = [0.0] * length
        self.reached = [0.0] * length

    def rate(self, i: int, prior: float) -> float:
        return (self.accepted[i] + self.strength * prior) / (self.reached[i] + self.strength)

    def observe(self, drafted: int, accepted: int, shared: AcceptanceByPosition) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted`: positions 0..accepted
        were reached (the one after the last accepted was rejected, if there is one). This estimate
        (a request's own) and `shared` (its kind's, as long) hear it together, in one loop: every
        drafting step of every request updates both."""
        reached, hits, decay = self.reached, self.accepted, self.decay
        shared_reached, shared_hits, shared_decay = shared.reached, shared.accepted, shared.decay
        for i in range(min(drafted, accepted + 1)):
            hit = i < accepted
            reached[i] = decay * reached[i] + 1
            hits[i] = decay * hits[i] + hit
            shared_reached[i] = shared_decay * shared_reached[i] + 1
            shared_hits[i] = shared_decay * shared_hits[i] + hit


class DecayedRate:
    """P(hit) from decayed counts of hits among trials, shrunk towards a prior with the weight of
    `strength` trials: AcceptanceByPosition's estimate for a single event (an n-gram lookup finding
    drafts), as two floats (a one-position AcceptanceByPosition cost the rule 0.25 us a step more)."""

    __slots__ = ("decay", "hits", "strength", "trials")

    def __init__(self, decay: float, strength: float = 4.0):
        self.decay, self.strength = decay, strength
        self.hits = self.trials = 0.0

    def observe(self, hit: bool) -> None:
        self.hits = self.decay * self.hits + hit
        self.trials = self.decay * self.trials + 1

    def rate(self, prior: float) -> float:
        return (self.hits + self.strength * prior) / (self.trials + self.strength)


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
