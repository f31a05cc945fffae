"""A paired comparison: a candidate's cost relative to a control measured in the same window.

Why: windows taken minutes apart on a machine whose speed drifts (other tenants, bursts, thermal
limits) compare the drift, not the policies. Two arms served side by side, interleaved request by
request, see the same machine, so their *ratio* cancels a slowdown that hits both.

The statistic: each arm's cost is a ratio estimator, total seconds / total committed tokens over its
requests. Its variance comes from the per-request costs by the delta method,
    Var(R) ~= sum_i (s_i - R n_i)^2 / (sum_i n_i)^2 * m / (m - 1)      (m requests)
and the candidate / control ratio is taken on the log scale, where the two independent arms' relative
variances add: Var(log Rc - log Rk) ~= Var(Rc)/Rc^2 + Var(Rk)/Rk^2. The interval is
exp(log ratio +- z * sd): asymmetric, always positive, and it narrows as requests accumulate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.window import WindowStats

Z_95 = 1.959964


def relative_variance(costs: list[tuple[float, int]]) -> float:
    """Var(R) / R^2 of the ratio estimator R = sum(seconds) / sum(tokens); inf with < 2 requests."""
    m = len(costs)
    seconds = sum(s for s, _ in costs)
    tokens = sum(n for _, n in costs)
    if m < 2 or tokens <= 0 or seconds <= 0:
        return math.inf
    r = seconds / tokens
    residual = sum((s - r * n) ** 2 for s, n in costs)
    return residual / tokens**2 * m / (m - 1) / r**2


@dataclass(frozen=True)
class PairedRatio:
    ratio: float  # candidate cost / control cost (< 1: the candidate is cheaper)
    low: float  # confidence interval at `z`
    high: float
    candidate_requests: int
    control_requests: int

    @classmethod
    def of(cls, candidate: WindowStats, control: WindowStats, z: float = Z_95) -> PairedRatio:
        c, k = candidate.seconds_per_token, control.seconds_per_token
        if not (math.isfinite(c) and math.isfinite(k)) or k <= 0 or c <= 0:
            return cls(math.inf if k > 0 else math.nan, 0.0, math.inf, candidate.requests, control.requests)
        ratio = c / k
        sd = math.sqrt(relative_variance(candidate.request_costs) + relative_variance(control.request_costs))
        if not math.isfinite(sd):
            return cls(ratio, 0.0, math.inf, candidate.requests, control.requests)
        return cls(ratio, ratio * math.exp(-z * sd), ratio * math.exp(z * sd), candidate.requests,
                   control.requests)

    @property
    def better(self) -> bool:
        """The candidate is cheaper than the control with confidence (the whole interval below 1)."""
        return self.high < 1.0

    @property
    def worse(self) -> bool:
        return self.low > 1.0

    def as_attrs(self) -> dict[str, object]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"paired_ratio": finite(self.ratio), "paired_ratio_low": finite(self.low),
                "paired_ratio_high": finite(self.high), "paired_candidate_requests": self.candidate_requests,
                "paired_control_requests": self.control_requests}
