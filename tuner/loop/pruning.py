"""The online-safety rule: stop serving a trial policy that is clearly worse than the incumbent.

Every token served during a bad trial is a real user's token served slowly, so a trial is pruned as
soon as its running cost exceeds `factor` x the incumbent's mean cost. The running cost of the
first few requests is noisy (one slow request, a cold cache), hence the rule only fires once the
window holds `min_fraction` of its required tokens and steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PruneRule:
    factor: float = 1.5  # "far worse": 50% more cost per committed token than the incumbent
    min_fraction: float = 0.25  # of the window's min tokens and min steps, before judging

    def should_prune(
        self, running: float, tokens: int, steps: int, min_tokens: int, min_steps: int, incumbent: float | None
    ) -> bool:
        if incumbent is None or self.factor <= 0:
            return False  # nothing to compare against (first trial) or pruning disabled
        if tokens < self.min_fraction * min_tokens or steps < self.min_fraction * min_steps:
            return False
        return running > self.factor * incumbent
