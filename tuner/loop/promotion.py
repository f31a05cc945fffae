"""Promotion: when a challenger replaces the continuous tuner's incumbent.

Only after it beat the incumbent with confidence in `confirmations` challenge rounds in a row; the
continuous loop re-challenges a pending challenger at once, so confirming costs one round.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.types import DraftPolicy
from tuner.loop.space import policy_key


@dataclass
class PromotionGate:
    """A challenger replaces the incumbent only after beating it with confidence in `confirmations`
    challenge rounds in a row (the continuous loop re-challenges a pending one at once). Why: a
    round's interval covers the requests' noise, not a machine whose speed moved between windows
    (interleaved rounds) or a lucky draw among near-equal policies, so on a steady workload a
    one-round rule promotes back and forth between near-equal policies, each time "with
    confidence". A round in which the pending challenger is not better clears it."""

    confirmations: int = 2
    pending: DraftPolicy | None = None
    wins: int = 0

    def observe(self, policy: DraftPolicy, better: bool) -> bool:
        """True when `policy` is to be promoted now."""
        same = self.pending is not None and policy_key(self.pending) == policy_key(policy)
        if not better:
            if same:
                self.pending, self.wins = None, 0
            return False
        self.wins = self.wins + 1 if same else 1
        self.pending = policy
        if self.wins >= self.confirmations:
            self.pending, self.wins = None, 0
            return True
        return False
