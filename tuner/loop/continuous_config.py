"""The continuous tuner's settings, shared by its loop (`continuous.ContinuousTuner`) and the rules
it applies (`shift.ShiftDetector`); the CLI and the shift benchmark fill it from their flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContinuousConfig:
    exploration_share: float = 0.1  # of the requests, for the challenger
    min_gain: float = 0.02  # a challenger must be cheaper by at least this much, with confidence
    promote_confirmations: int = 2  # ...in this many rounds in a row (it is re-challenged at once)
    reopen_trials: int = 12  # search trials when the search re-opens on a workload shift
    plain_shift: float = 0.25  # relative move of the incumbent's cost relative to plain decoding
    acceptance_shift: float = 0.15  # absolute move of the incumbent's acceptance rate
    confirmations: int = 2  # consecutive acceptance observations that must agree
    probe_plain_every: int = 3  # every Nth challenge is plain decoding (when the incumbent speculates)
    min_drafted_for_acceptance: int = 64  # drafted tokens a window needs before its acceptance counts
    idle_seconds: float = 5.0  # incumbent alone between rounds; doubles while nothing changes
    max_idle_seconds: float = 300.0
    # Between rounds the worker checks this often that the server still runs the incumbent (a restarted
    # server comes back with its start-up policy) and whether the fleet's incumbent changed in the study.
    policy_check_seconds: float = 1.0
    runners_up: int = 3
    max_decisions: int = 200
