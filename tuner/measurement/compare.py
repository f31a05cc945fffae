"""Measure a few named policies side by side on live traffic (the demo's and the benchmark's final table).

Contract: `rounds` rounds, each measuring every policy once through the same `Measurer` (same window,
no pruning), with the order rotated every round so a drift in load or machine speed does not
favour whichever policy happens to go first. Each policy's windows are merged (exact sums), so its
figure is total seconds / total committed tokens over all its rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from service.types import DraftPolicy
from tuner.loop.space import policy_key
from tuner.measurement.measure import Measurement, Measurer, Outcome
from tuner.measurement.paired import PairedRatio
from tuner.measurement.window import WindowStats


@dataclass
class Compared:
    name: str
    policy: DraftPolicy
    stats: WindowStats  # all rounds merged
    per_round: list[float]  # seconds per committed token of each round (inf when starved)
    starved: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.stats.seconds_per_token

    def as_dict(self, decode_step_seconds: float) -> dict[str, object]:
        return {
            "name": self.name,
            "policy": policy_key(self.policy).label(),
            "drafter": self.policy.drafter.value,
            "draft_length": self.policy.draft_length,
            "draft_temperature": self.policy.draft_temperature,
            "tree_width": self.policy.tree_width,
            "seconds_per_token": self.seconds_per_token if self.stats.committed else None,
            "per_round": [x if x != float("inf") else None for x in self.per_round],
            "starved_rounds": self.starved,
            "acceptance_rate": self.stats.acceptance_rate,
            "committed_per_step": self.stats.committed / self.stats.steps if self.stats.steps else 0.0,
            "unique_experts_mean": list(self.stats.unique_experts_mean),
            "decode_step_equivalents": self.stats.decode_step_equivalents(decode_step_seconds),
            "committed_tokens": self.stats.committed,
            "requests": self.stats.requests,
        }


def compare(
    measurer: Measurer,
    policies: dict[str, DraftPolicy],
    rounds: int,
    id_prefix: str,
    on_measured: Callable[[str, int, float], None] = lambda name, rnd, value: None,
    on_starved: Callable[[str, int, Measurement], None] = lambda name, rnd, m: None,
) -> list[Compared]:
    names = list(policies)
    out = {n: Compared(n, policies[n], WindowStats(f"{id_prefix}/{n}"), []) for n in names}
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            policy = replace(policies[name], policy_id=f"{id_prefix}/{name}-r{rnd}")
            m = measurer.measure(policy, incumbent_value=None)
            entry = out[name]
            if m.outcome is Outcome.STARVED:
                entry.starved += 1
                on_starved(name, rnd, m)
            entry.stats.merge(m.stats)
            entry.per_round.append(m.stats.seconds_per_token)
            on_measured(name, rnd, m.stats.seconds_per_token)
    return [out[n] for n in names]


@dataclass
class PairedCompared:
    """One policy against a reference, both arms of every round in one traffic split."""

    name: str
    policy: DraftPolicy
    candidate: WindowStats  # all rounds merged
    reference: WindowStats  # the reference arm of the same windows, merged
    per_round: list[float]  # candidate / reference cost ratio of each round (inf when starved)
    starved: int = 0

    @property
    def ratio(self) -> PairedRatio:
        """Pooled over the rounds (exact sums per arm), with its 95% interval from per-request costs."""
        return PairedRatio.of(self.candidate, self.reference)

    def as_dict(self) -> dict[str, object]:
        r = self.ratio
        return {"name": self.name, "policy": policy_key(self.policy).label(), **r.as_attrs(),
                "per_round": [x if x != float("inf") else None for x in self.per_round],
                "starved_rounds": self.starved,
                "seconds_per_token": self.candidate.seconds_per_token if self.candidate.committed else None,
                "reference_seconds_per_token": self.reference.seconds_per_token if self.reference.committed else None}


def compare_paired(
    measurer: Measurer,
    reference: DraftPolicy,
    policies: dict[str, DraftPolicy],
    rounds: int,
    id_prefix: str,
    share: float = 0.5,
    shared_passes: bool = False,
) -> list[PairedCompared]:
    """Each policy beside `reference`, `rounds` windows each, the order rotated every round. The
    figure per policy is its cost relative to the reference in the same rounds, so a machine whose
    speed changes between rounds moves both arms and leaves the ratio alone, unlike `compare`, whose
    absolute per-round figures carry the drift. A policy equal to the reference is not measured
    against itself.

    Where requests share target passes (`ModelInfo.shared_passes`: a batching server charges each
    request its whole pass, so in one traffic split a short-window arm pays for the long windows
    beside it and the ratio shrinks towards 1), each round measures the two arms in back-to-back
    windows of their own instead, the order alternating by round (reference first in even rounds)
    so a linear drift cancels over a pair of rounds. Otherwise both arms share one traffic split,
    interleaved request by request."""
    names = [n for n in policies if policy_key(policies[n]) != policy_key(reference)]
    out = {n: PairedCompared(n, policies[n], WindowStats(f"{id_prefix}/{n}"), WindowStats(f"{id_prefix}/{n}/ref"), [])
           for n in names}
    for rnd in range(rounds):
        shift = rnd % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            cand = replace(policies[name], policy_id=f"{id_prefix}/{name}-r{rnd}")
            ref = replace(reference, policy_id=f"{id_prefix}/{name}-r{rnd}/ref")
            if shared_passes:
                candidate, control = _back_to_back(measurer, cand, ref, reference_first=rnd % 2 == 0)
                ratio = PairedRatio.of(candidate.stats, control).ratio
            else:
                m = measurer.measure_paired(cand, ref, share, 1.0, prune=False)
                candidate, control, ratio = m.candidate, m.control, m.ratio.ratio
            entry = out[name]
            if candidate.outcome is Outcome.STARVED:
                entry.starved += 1
            entry.candidate.merge(candidate.stats)
            entry.reference.merge(control)
            entry.per_round.append(ratio)
    return [out[n] for n in names]


def _back_to_back(measurer: Measurer, cand: DraftPolicy, ref: DraftPolicy,
                  reference_first: bool) -> tuple[Measurement, WindowStats]:
    """The candidate's and the reference's windows one after the other, each arm alone on the server."""
    first, second = (ref, cand) if reference_first else (cand, ref)
    measured = {p.policy_id: measurer.measure(p, incumbent_value=None) for p in (first, second)}
    return measured[cand.policy_id], measured[ref.policy_id].stats
