"""The tuning loop's settings, one frozen record shared by the loop (`tuning.Tuner`) and the
trial it runs (`trial.TrialRunner`); `assemble.assemble` fills it from `TuneSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.types import DraftPolicy
from tuner.measurement.measure import TrialMode


@dataclass(frozen=True)
class TunerConfig:
    study_name: str
    trials: int
    tuner_id: str
    remeasure_top: int = 3
    stale_seconds: float = 120.0  # another tuner's RUNNING trial with no heartbeat this long is dead
    max_consecutive_failures: int = 3
    initial_policies: tuple[DraftPolicy, ...] = ()  # enqueued, in order, when the study is fresh
    mode: TrialMode = TrialMode.PAIRED
    candidate_share: float = 0.5  # of the requests, for the candidate arm of a paired trial
    switch_window_factor: float = 10.0  # a window lasts >= this x ModelInfo.policy_switch_seconds
    max_consecutive_duplicates: int = 20  # re-proposals in a row that end the search as converged
    whatif_recording: Path | None = None  # the server's --record-steps file: enables the what-if hint
    whatif_margin: float = 0.05  # a shorter length is suggested when predicted cheaper by more than this
    fleet_wait_seconds: float = 1.0  # a fleet worker with no trial to start polls the study this often
