"""Workload shift: has the workload changed under the continuous tuner's incumbent?

Two signals, each from the challenge rounds' paired windows. The incumbent's cost relative to plain
decoding (pooled over the plain probes since it was chosen) moves by more than `plain_shift` with
the pooled value outside the new probe's interval; or the incumbent's acceptance rate moves by more
than `acceptance_shift`. Either must hold in `confirmations` consecutive observations (one probe
suffices when plain decoding beats the incumbent with confidence). On a shift the continuous tuner
re-opens the search in a fresh study.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.loop.continuous_config import ContinuousConfig


@dataclass
class ShiftDetector:
    """Decides from challenge windows whether the workload changed under the incumbent.

    The plain-decoding baseline comes from the plain probes themselves (paired, same window), never
    from the search's values: the search's winner is the policy whose measurement was luckiest, so
    its value is biased low and a baseline built on it flags a shift that is only regression to the
    mean. Probes that signal nothing are pooled into the baseline (geometric mean); a shift needs
    `confirmations` signalling probes in a row, or one in which plain decoding beats the incumbent
    with confidence."""

    config: ContinuousConfig
    plain_ratio: float | None = None  # cost(plain) / cost(incumbent), pooled over this incumbent's probes
    acceptance: float | None = None  # the incumbent's acceptance rate when it was chosen
    plain_probes: int = 0
    _plain_strikes: int = 0
    _acceptance_strikes: int = 0

    def observe_plain_probe(self, ratio: float, low: float, high: float) -> str | None:
        """`ratio` = cost(plain) / cost(incumbent) from a paired window, with its interval."""
        if not math.isfinite(ratio) or ratio <= 0:
            return None
        if self.plain_ratio is None:
            self.plain_ratio, self.plain_probes = ratio, 1
            return None
        moved = abs(math.log(ratio / self.plain_ratio)) > math.log1p(self.config.plain_shift)
        if moved and not low <= self.plain_ratio <= high:
            self._plain_strikes += 1
            # Plain decoding beating the incumbent with confidence needs no second look.
            if self._plain_strikes >= self.config.confirmations or high < 1.0:
                return (f"plain decoding now costs {ratio:.2f}x the incumbent (interval {low:.2f}-{high:.2f}), "
                        f"was {self.plain_ratio:.2f}x over {self.plain_probes} probes; {self._plain_strikes} "
                        f"probes in a row")
            return None
        self._plain_strikes = 0
        n = self.plain_probes
        self.plain_ratio = math.exp((n * math.log(self.plain_ratio) + math.log(ratio)) / (n + 1))
        self.plain_probes = n + 1
        return None

    def observe_acceptance(self, acceptance: float, drafted: int) -> str | None:
        if drafted < self.config.min_drafted_for_acceptance:
            return None
        if self.acceptance is None:
            self.acceptance = acceptance
            return None
        if abs(acceptance - self.acceptance) > self.config.acceptance_shift:
            self._acceptance_strikes += 1
        else:
            self._acceptance_strikes = 0
        if self._acceptance_strikes >= self.config.confirmations:
            return (f"the incumbent's acceptance rate moved from {self.acceptance:.2f} to {acceptance:.2f} "
                    f"in {self._acceptance_strikes} windows in a row")
        return None
