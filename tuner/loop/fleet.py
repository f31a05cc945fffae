"""Several `moespec tune` workers, one per replica, on one Optuna study (docs/fleet.md).

Contract:
- `Fleet.claim(study, trial, key)`: before a worker measures a policy it claims it in the study's
  database (tuner/claims.py); None = measure it, else who is measuring it now (the worker tells its
  own trial FAIL with `fail_reason` "busy: ...", which never counts towards the budget, and asks
  again). A claim of a trial that is no longer RUNNING (its worker died and the trial was failed)
  is taken over. `release` after the trial is told.
- `take_budget_slot(study, storage, trial, budget)`: before a search trial is measured it takes one
  of the budget's `budget` slots (a claim row per slot): the database lets one worker take each, so
  workers that ask at the same moment cannot together overshoot the budget. A slot whose trial ended
  without counting (failed, busy, a re-proposal; `study.counts_towards_budget`) is taken over.
- `in_flight_elsewhere(study)`: RUNNING search trials of other workers, so a worker does not ask a
  trial the budget has no room for (the budget is shared: finished search trials of the study).
- `once(study, what)`: true for one worker only (the initial design and each re-measurement are
  enqueued once, not once per worker).
- `keep(...)`: between rounds a continuous worker waits in slices of `check_seconds`; each slice it
  re-applies its policy where the server lost it (a restarted server comes back with its start-up
  policy) and adopts the fleet's incumbent from the study. So a restarted server has the policy back
  within `check_seconds` plus one SetPolicy after it answers again (the bound the worker prints).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from tuner.loop import study as st
from tuner.loop.claims import NoClaims, PolicyClaims
from tuner.loop.space import PolicyKey
from tuner.measurement.admin import ServerUnavailable


def claim_key(key: PolicyKey) -> str:
    """Exact (not the rounded label): two temperatures that print alike are still two policies. A tree
    appends its width (a chain's key is unchanged, so claims already stored keep their meaning)."""
    chain = f"{key.drafter}|{key.draft_length}|{key.draft_temperature!r}"
    return chain if key.tree_width == 1 else f"{chain}|tw{key.tree_width}"


@dataclass
class Fleet:
    claims: PolicyClaims | NoClaims
    worker: str  # this worker's tuner id

    def claim(self, study: optuna.Study, storage: optuna.storages.BaseStorage, trial: int,
              key: PolicyKey) -> str | None:
        def running(number: int) -> bool:
            try:
                return storage.get_trial(st.trial_id(storage, study, number)).state is TrialState.RUNNING
            except KeyError:
                return False

        return self.claims.claim(study.study_name, claim_key(key), trial, self.worker, running)

    def take_budget_slot(self, study: optuna.Study, storage: optuna.storages.BaseStorage, trial: int,
                         budget: int) -> bool:
        def holds(number: int) -> bool:  # a slot stays taken while its trial runs or counts
            try:
                t = storage.get_trial(st.trial_id(storage, study, number))
            except KeyError:
                return False
            return t.state is TrialState.RUNNING or st.counts_towards_budget(t)

        return any(self.claims.claim(study.study_name, f"budget:{slot}", trial, self.worker, holds) is None
                   for slot in range(budget))

    def release(self, study: optuna.Study, trial: int, key: PolicyKey) -> None:
        self.claims.release(study.study_name, claim_key(key), trial)

    def once(self, study: optuna.Study, what: str) -> bool:
        """True for exactly one worker of the study (which enqueues the initial design, a re-measurement)."""
        return self.claims.once(study.study_name, what, self.worker)

    def in_flight_elsewhere(self, study: optuna.Study, roles: tuple[str, ...] = (st.ROLE_SEARCH,)) -> int:
        return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if st.role(t) in roles and t.user_attrs.get("tuner_id") not in (None, self.worker))


def single_worker(worker: str) -> Fleet:
    """A worker alone on its study (journal / Redis storage, or library callers)."""
    return Fleet(NoClaims(), worker)


def keep(
    stop: threading.Event,
    seconds: float,
    check_seconds: float,
    ensure: Callable[[], bool],
    on_reapplied: Callable[[float], None],
    adopt: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Wait `seconds` (or until `stop`), keeping the policy on the server and following the fleet.
    `ensure()` re-applies the policy where the server runs another one (True when it had to);
    `on_reapplied(s)` gets the seconds since the last check that found the server right."""
    end = clock() + seconds
    last_ok = clock()
    while not stop.is_set():
        try:
            if ensure():
                on_reapplied(clock() - last_ok)
            last_ok = clock()
        except ServerUnavailable:
            pass  # down: the next slice tries again
        adopt()
        left = end - clock()
        if left <= 0:
            return
        stop.wait(min(check_seconds, left))
