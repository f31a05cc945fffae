"""Objective accounting over a trial window: the request spans one policy produced.

Contract: a window is the sum of the exact per-request aggregates (request spans are never
sampled), so every figure here is exact for the requests it holds:
- measured cost = (draft + verify seconds) / committed tokens (prefill excluded: it does not
  depend on the draft policy);
- modelled cost = target weight bytes touched per committed token, from the per-layer unique
  routed experts of every verify pass plus the bytes every pass reads anyway (shared experts,
  attention, norms). The draft model's own bytes are not counted (see `CostModel`).
Per-layer means are step-weighted: a request's `unique_experts_mean[l] * verify_steps` is the
exact sum over its passes, so the window mean is sum / steps, never a mean of means.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSample:
    """One request span's aggregates (what `spans.request_sample` extracts)."""

    policy_id: str
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    committed_tokens: int
    unique_experts_mean: tuple[float, ...]  # [L] mean distinct routed experts per verify pass
    draft_seconds: float
    verify_seconds: float
    output_tokens: int = 0
    drafter: str = ""  # the policy the server says it ran ("" / -1 when the span does not say)
    draft_length: int = -1
    draft_temperature: float = 1.0
    tree_width: int = 1  # the span's moespec.spec.tree_width (absent: a chain)
    ep_dispatch_bytes: int = 0  # expert-parallel all-to-all estimate (0 unless the server runs --ep-size)
    instance_id: str = ""  # the sending server's service.instance.id resource attribute ("" = none)


@dataclass(frozen=True)
class CostModel:
    """Bytes a verify pass reads: `expert_bytes` per unique routed expert per layer, plus a fixed
    part per pass. The draft's bytes are left out on purpose: for the n-gram drafter they are
    zero, and for the model drafter its cost shows up in the measured objective instead."""

    expert_bytes: int
    fixed_bytes_per_pass: int = 0  # shared experts + dense weights, read by every pass
    # Under expert parallelism (`moespec tune --ep-size`): weight of one dispatched byte against one
    # weight byte read. 2: the combine sends back what the dispatch sent; 0: EP ignored.
    ep_byte_weight: float = 0.0

    def bytes_per_pass(self, unique_experts: tuple[float, ...]) -> float:
        return sum(unique_experts) * self.expert_bytes + self.fixed_bytes_per_pass


@dataclass
class WindowStats:
    """Running sums for one policy id; `add` is the only mutator (the collector holds the lock)."""

    policy_id: str
    requests: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    output_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    expert_step_sums: list[float] = field(default_factory=list)  # [L] sum over passes of unique experts
    # (draft + verify seconds, committed tokens) of each request: the spread a confidence interval needs
    request_costs: list[tuple[float, int]] = field(default_factory=list)
    ep_dispatch_bytes: int = 0

    def add(self, sample: RequestSample) -> None:
        self.request_costs.append((sample.draft_seconds + sample.verify_seconds, sample.committed_tokens))
        self.requests += 1
        self.steps += sample.verify_steps
        self.drafted += sample.drafted_tokens
        self.accepted += sample.accepted_tokens
        self.committed += sample.committed_tokens
        self.output_tokens += sample.output_tokens
        self.draft_seconds += sample.draft_seconds
        self.verify_seconds += sample.verify_seconds
        self.ep_dispatch_bytes += sample.ep_dispatch_bytes
        layers = len(sample.unique_experts_mean)
        if len(self.expert_step_sums) < layers:
            self.expert_step_sums.extend([0.0] * (layers - len(self.expert_step_sums)))
        for layer, mean in enumerate(sample.unique_experts_mean):
            self.expert_step_sums[layer] += mean * sample.verify_steps

    def merge(self, other: WindowStats) -> None:
        """Fold another window of the same policy in (sums stay exact)."""
        for name in ("requests", "steps", "drafted", "accepted", "committed", "output_tokens",
                     "draft_seconds", "verify_seconds", "ep_dispatch_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if len(self.expert_step_sums) < len(other.expert_step_sums):
            self.expert_step_sums.extend([0.0] * (len(other.expert_step_sums) - len(self.expert_step_sums)))
        for layer, total in enumerate(other.expert_step_sums):
            self.expert_step_sums[layer] += total
        self.request_costs.extend(other.request_costs)

    def copy(self) -> WindowStats:
        return WindowStats(**{**self.__dict__, "expert_step_sums": list(self.expert_step_sums),
                              "request_costs": list(self.request_costs)})

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.committed if self.committed else float("inf")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def unique_experts_mean(self) -> tuple[float, ...]:
        return tuple(s / self.steps for s in self.expert_step_sums) if self.steps else ()

    @property
    def widest_layer(self) -> int:
        means = self.unique_experts_mean
        return max(range(len(means)), key=means.__getitem__) if means else -1

    def decode_step_equivalents(self, decode_step_seconds: float) -> float:
        """Mean verify pass cost in plain decode steps (1.0 for plain decoding, by construction)."""
        if not self.steps or decode_step_seconds <= 0:
            return 0.0
        return self.verify_seconds / self.steps / decode_step_seconds

    def modelled_bytes_per_token(self, cost: CostModel) -> float:
        if not self.committed:
            return float("inf")
        total = sum(self.expert_step_sums) * cost.expert_bytes + self.steps * cost.fixed_bytes_per_pass
        total += cost.ep_byte_weight * self.ep_dispatch_bytes
        return total / self.committed

    def user_attrs(self, cost: CostModel, decode_step_seconds: float) -> dict[str, object]:
        """The secondary figures stored beside a trial's value (JSON-serialisable)."""
        return {
            "seconds_per_token": self.seconds_per_token if self.committed else None,
            "modelled_bytes_per_token": self.modelled_bytes_per_token(cost) if self.committed else None,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_per_step": self.mean_accepted_per_step,
            "unique_experts_mean": [round(x, 4) for x in self.unique_experts_mean],
            "widest_layer": self.widest_layer,
            "decode_step_equivalents": self.decode_step_equivalents(decode_step_seconds),
            "requests": self.requests,
            "verify_steps": self.steps,
            "committed_tokens": self.committed,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "output_tokens": self.output_tokens,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "ep_dispatch_bytes_per_token": self.ep_dispatch_bytes / self.committed if self.committed else None,
        }


class Objective(enum.StrEnum):
    MEASURED = "measured"  # seconds per committed token
    MODELLED = "modelled"  # target weight bytes touched per committed token

    def of(self, stats: WindowStats, cost: CostModel) -> float:
        if self is Objective.MEASURED:
            return stats.seconds_per_token
        return stats.modelled_bytes_per_token(cost)


class WindowState(enum.StrEnum):
    OPEN = "open"  # keep waiting
    COMPLETE = "complete"  # enough tokens and steps: tell the value
    STARVED = "starved"  # wall time ran out first: tell FAIL, not a number


@dataclass(frozen=True)
class WindowSpec:
    """When a trial's window is done. Every minimum must hold; `max_seconds` bounds the wait.
    `min_seconds` makes a window last long enough to amortise an expensive policy switch (SGLang)."""

    min_tokens: int = 256
    min_steps: int = 32
    max_seconds: float = 60.0
    min_seconds: float = 0.0

    def state(self, stats: WindowStats, elapsed: float) -> WindowState:
        if stats.committed >= self.min_tokens and stats.steps >= self.min_steps and elapsed >= self.min_seconds:
            return WindowState.COMPLETE
        if elapsed >= self.max_seconds:
            return WindowState.STARVED
        return WindowState.OPEN
