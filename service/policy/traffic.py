"""Traffic split: several draft policies served at once, each request assigned one arm when it starts.

Contract:
- A `TrafficSplit` holds 1..MAX_ARMS arms `{policy, weight}` and the seed of its assignment draws.
  `validate` refuses a bad split with InvalidRequest naming the field as the proto spells it
  (`split.arms[1].weight`, `split.arms[0].policy.draft_length`, ...), so gRPC answers
  INVALID_ARGUMENT with the same message every entry point gives.
- `ArmAssigner` draws one arm per request from `random.Random(seed)`, in request order: the same
  seed and the same order of requests give the same assignment, which is what makes a split
  reproducible in a test. Arms get weight / sum(weights) of the requests in expectation.
- A single-arm split with weight 1 is exactly the old "one current policy".
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.types import DraftPolicy, InvalidRequest

MAX_ARMS = 8


@dataclass(frozen=True)
class TrafficArm:
    policy: DraftPolicy
    weight: float = 1.0


@dataclass(frozen=True)
class TrafficSplit:
    arms: tuple[TrafficArm, ...]
    seed: int | None = None  # None: the server picks one when the split is set

    @classmethod
    def single(cls, policy: DraftPolicy, seed: int | None = None) -> TrafficSplit:
        return cls((TrafficArm(policy, 1.0),), seed)

    @property
    def primary(self) -> DraftPolicy:
        """The first arm's policy: what GetPolicy reports (by convention the control arm)."""
        return self.arms[0].policy

    @property
    def shares(self) -> tuple[float, ...]:
        total = sum(a.weight for a in self.arms)
        return tuple(a.weight / total for a in self.arms)

    def validate(self, check_policy: Callable[[DraftPolicy], DraftPolicy], concurrent: bool) -> TrafficSplit:
        """The split as it will be stored: each policy through `check_policy` (backend bounds and
        policy_id derivation, field names re-rooted under the arm), or InvalidRequest."""
        if not self.arms:
            raise InvalidRequest("split.arms", "is empty: give at least one arm")
        if len(self.arms) > MAX_ARMS:
            raise InvalidRequest("split.arms", f"at most {MAX_ARMS} arms, got {len(self.arms)}")
        if len(self.arms) > 1 and not concurrent:
            raise InvalidRequest(
                "split.arms",
                f"this backend runs one policy at a time (ModelInfo.concurrent_policies is false), got "
                f"{len(self.arms)} arms",
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequest("split.seed", f"must be in [0, 2^64), got {self.seed}")
        arms, seen = [], {}
        for i, arm in enumerate(self.arms):
            if not math.isfinite(arm.weight) or arm.weight <= 0:
                raise InvalidRequest(f"split.arms[{i}].weight", f"must be a finite number > 0, got {arm.weight}")
            try:
                policy = check_policy(arm.policy)
            except InvalidRequest as e:
                problem = str(e).removeprefix(f"{e.field}: ")
                raise InvalidRequest(f"split.arms[{i}].{e.field}", problem) from None
            if policy.policy_id in seen:
                raise InvalidRequest(
                    f"split.arms[{i}].policy.policy_id",
                    f"{policy.policy_id!r} is also arm {seen[policy.policy_id]}'s: responses name their arm by it",
                )
            seen[policy.policy_id] = i
            arms.append(replace(arm, policy=policy))
        return replace(self, arms=tuple(arms))


class ArmAssigner:
    """Seeded per-request arm draws for one split (a new split starts a new sequence)."""

    def __init__(self, split: TrafficSplit):
        if split.seed is None:
            raise ValueError("ArmAssigner needs a seeded split")
        self.split = split
        self._rng = random.Random(split.seed)
        total = sum(a.weight for a in split.arms)
        self._cumulative = [sum(a.weight for a in split.arms[: i + 1]) / total for i in range(len(split.arms))]

    def next_index(self) -> int:
        if len(self.split.arms) == 1:
            return 0
        u = self._rng.random()
        for i, edge in enumerate(self._cumulative):
            if u < edge:
                return i
        return len(self._cumulative) - 1  # u within rounding of 1.0

    def next_policy(self) -> DraftPolicy:
        return self.split.arms[self.next_index()].policy
