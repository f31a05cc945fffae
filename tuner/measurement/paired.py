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

Interleaved windows (control, candidate, control: one policy per window) add a term the requests
cannot show: the machine's speed moving between windows. `drift_log_variance` estimates it from the
two control windows and `PairedRatio.of(..., extra_log_variance=...)` adds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.measurement.window import WindowStats

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


def drift_log_variance(before: WindowStats, after: WindowStats) -> float:
    """The log-scale variance that a machine whose speed moves between windows adds to a candidate
    window compared with the mean of the control windows before and after it. The two controls' log
    costs differ by d; two samples estimate the between-window variance as d^2 / 2, and a window
    against the mean of two carries it 1 + 1/2 times: 0.75 d^2 (one pair makes a rough estimate, but
    it is zero only when the machine held still, and it widens the interval when it did not)."""
    a, b = before.seconds_per_token, after.seconds_per_token
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
        return 0.0
    return 0.75 * math.log(a / b) ** 2


@dataclass(frozen=True)
class PairedRatio:
    ratio: float  # candidate cost / control cost (< 1: the candidate is cheaper)
    low: float  # confidence interval at `z`
    high: float
    candidate_requests: int
    control_requests: int

    @classmethod
    def of(cls, candidate: WindowStats, control: WindowStats, z: float = Z_95,
           extra_log_variance: float = 0.0) -> PairedRatio:
        c, k = candidate.seconds_per_token, control.seconds_per_token
        if not (math.isfinite(c) and math.isfinite(k)) or k <= 0 or c <= 0:
            return cls(math.inf if k > 0 else math.nan, 0.0, math.inf, candidate.requests, control.requests)
        ratio = c / k
        sd = math.sqrt(relative_variance(candidate.request_costs) + relative_variance(control.request_costs)
                       + extra_log_variance)
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
