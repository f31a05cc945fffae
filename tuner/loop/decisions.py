"""The continuous tuner's record in the root study: its decision log and the state a restart resumes.

Every decision (initial | kept | promote | reopen) is appended to the root study's user attribute
"decisions" (the last `max_decisions`), and the state after it to "continuous": the epoch, the
incumbent and the shift detector's baselines. The study is the one place the fleet shares, so a
restarted worker keeps what was decided and the other workers adopt it from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import optuna

from tuner.loop import study as st
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.shift import ShiftDetector
from tuner.loop.space import SearchSpace, policy_key


@dataclass(frozen=True)
class Decision:
    kind: str  # initial | kept | promote | reopen
    policy: str  # label of the incumbent after the decision
    policy_id: str
    value: float
    epoch: int
    reason: str
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "policy": self.policy, "policy_id": self.policy_id, "value": self.value,
                "epoch": self.epoch, "reason": self.reason, "at": round(self.at, 3)}


def saved_state(root: optuna.Study) -> dict:
    """The state the last decision saved (empty before any)."""
    return root.user_attrs.get("continuous", {})


def record(
    root: optuna.Study,
    decision: Decision,
    space: SearchSpace,
    incumbent: st.PolicyScore,
    detector: ShiftDetector,
    max_decisions: int,
) -> None:
    """Append `decision` to the log and save the state after it."""
    decisions = list(root.user_attrs.get("decisions", []))[-(max_decisions - 1):]
    decisions.append(decision.as_dict())
    root.set_user_attr("decisions", decisions)
    root.set_user_attr("continuous", {
        "epoch": decision.epoch,
        "incumbent": {"params": space.params_of(incumbent.policy), "policy_id": incumbent.policy.policy_id,
                      "value": incumbent.mean, "trial": incumbent.trials[0], "label": incumbent.key.label()},
        "plain_ratio": detector.plain_ratio,
        "plain_probes": detector.plain_probes,
        "acceptance": detector.acceptance,
    })


def score_from_saved(space: SearchSpace, saved: dict) -> st.PolicyScore:
    """The saved incumbent (`saved_state(root)["incumbent"]`) as a score."""
    policy = space.policy_from_params(saved["params"], saved["policy_id"])
    value = float(saved["value"])
    return st.PolicyScore(policy_key(policy), policy, value, (value,), (int(saved["trial"]),))


def detector_from_saved(config: ContinuousConfig, saved: dict) -> ShiftDetector:
    """A shift detector resuming from the saved baselines (`saved_state(root)`)."""
    detector = ShiftDetector(config)
    detector.plain_ratio = saved.get("plain_ratio")
    detector.plain_probes = int(saved.get("plain_probes", 1 if saved.get("plain_ratio") else 0))
    detector.acceptance = saved.get("acceptance")
    return detector
