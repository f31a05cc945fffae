"""One trial of the tuning loop, from Optuna's ask to its tell.

Ask, claim the policy against the fleet's other workers (a "busy" FAIL when one is measuring it),
reuse the result of a policy already measured (loop/duplicates.py), else measure it against its
control (measurement/against_control.py), replay the what-if hint (loop/whatif_hint.py) and tell
the outcome (loop/tell.py). Whatever interrupts a trial (the server gone, the admin token refused,
Ctrl-C / SIGTERM, a bug) tells it FAIL with the reason before it propagates, so a restart finds
nothing to clean up. A continuous-mode challenge (`challenge`) is a trial of its own role beside
the incumbent; it stops (`Superseded`, told FAIL "superseded: ...") at the first heartbeat after
its `superseded` check names a reason: the fleet's incumbent, its control, changed under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.duplicates import reuse_incumbent, reuse_result
from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.fleet import Fleet
from tuner.loop.space import PolicyKey, SearchSpace, policy_key
from tuner.loop.tell import tell_failed, tell_measured
from tuner.loop.tuner_config import TunerConfig
from tuner.loop.whatif_hint import WhatIfHinter
from tuner.measurement.admin import AdminRejected, PolicyAdmin, ServerUnavailable
from tuner.measurement.against_control import AgainstControl
from tuner.measurement.measure import Measurement, Measurer, PairedMeasurement
from tuner.measurement.window import WindowStats


class Superseded(Exception):
    """A challenge's control is no longer the incumbent (another worker of the fleet decided):
    its measurement would judge the challenger against the wrong policy."""


@dataclass(frozen=True)
class Challenge:
    """A continuous-mode challenger's trial as it was told."""

    trial: int
    policy: DraftPolicy
    state: TrialState
    measurement: Measurement
    paired: PairedMeasurement | None  # None when it ran alone (sequential mode)


class TrialRunner:
    def __init__(
        self,
        study: optuna.Study,
        storage: optuna.storages.BaseStorage,
        space: SearchSpace,
        admin: PolicyAdmin,
        measurer: Measurer,
        config: TunerConfig,
        user_attrs: Callable[[WindowStats], dict[str, object]],
        fleet: Fleet,
        on_event: Callable[[TunerEvent], None] = lambda e: None,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._study = study
        self._storage = storage
        self._space = space
        self._admin = admin
        self._measurer = measurer
        self._config = config
        self._user_attrs = user_attrs
        self._fleet = fleet
        self._emit = on_event
        self._wall_clock = wall_clock
        self._claimed: tuple[int, PolicyKey] | None = None
        self._against_control = AgainstControl(measurer, admin, config.mode, config.switch_window_factor)
        self._hinter = WhatIfHinter(study, space, config.whatif_recording, config.whatif_margin,
                                    measurer.window.min_steps, on_event)

    def apply_incumbent(self) -> st.PolicyScore | None:
        """Put the incumbent (best mean over COMPLETE trials) on the server; it, or None before any."""
        best = st.incumbent(self._study, self._space)
        if best is not None:
            self._admin.apply(best.policy)
            self._emit(TunerEvent(EventKind.INCUMBENT, policy=best.policy, value=best.mean, best=best))
        return best

    def run(self, role: str, control: st.PolicyScore | None = None) -> tuple[TrialState, int]:
        """Ask and run one trial of `role`; its state and number. `control`: the paired control arm
        (default: the incumbent)."""
        trial = self._study.ask()
        try:
            with self._interruptions_told(trial):
                return self._run_asked(trial, role, control), trial.number
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker took this one for dead (no heartbeat for stale_seconds: a stalled machine)
            # and failed it: its result is lost, not counted, and the search goes on.
            return TrialState.FAIL, trial.number

    @contextmanager
    def _interruptions_told(self, trial: optuna.Trial) -> Iterator[None]:
        """Whatever interrupts `trial` tells it FAIL with the reason before it propagates (the
        bookkeeping a restart would do, done now); its fleet claim is released either way."""
        try:
            yield
        except ServerUnavailable as e:
            self._fail(trial, f"{st.FAIL_UNREACHABLE}: {e}")
            raise
        except AdminRejected:
            self._fail(trial, "admin token refused")
            raise
        except Superseded as e:
            self._fail(trial, f"{st.FAIL_SUPERSEDED}: {e}")
            raise
        except BaseException:  # Ctrl-C / SIGTERM, or a bug
            self._fail(trial, st.FAIL_INTERRUPTED)
            raise
        finally:
            self._release_claim()

    def _claim(self, trial: optuna.Trial, policy: DraftPolicy) -> bool:
        """Claim `policy` for this trial; False (the trial told FAIL "busy: ...") when another worker of
        the fleet is measuring it right now."""
        key = policy_key(policy)
        holder = self._fleet.claim(self._study, self._storage, trial.number, key)
        if holder is None:
            self._claimed = (trial.number, key)
            return True
        self._busy(trial, policy, f"{st.FAIL_BUSY}: {key.label()} is being measured by {holder}")
        return False

    def _busy(self, trial: optuna.Trial, policy: DraftPolicy, reason: str) -> None:
        """Tell FAIL a trial the fleet has no room for; it does not count and the loop asks again."""
        self._fail(trial, reason)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, str(trial.user_attrs.get("role", "")), policy,
                              TrialState.FAIL.name, message=f"{reason}; not counted, asking again"))

    def _release_claim(self) -> None:
        if self._claimed is not None:
            number, key = self._claimed
            self._claimed = None
            self._fleet.release(self._study, number, key)

    def _run_asked(self, trial: optuna.Trial, role: str, control: st.PolicyScore | None = None) -> TrialState:
        study, cfg = self._study, self._config
        role = str(trial.user_attrs.get("role", role))
        trial.set_user_attr("role", role)
        trial.set_user_attr("tuner_id", cfg.tuner_id)
        st.beat(trial, self._wall_clock)
        policy = self._space.suggest(trial, st.policy_id(study.study_name, trial.number))
        if role == st.ROLE_SEARCH and not self._fleet.take_budget_slot(study, self._storage, trial.number,
                                                                       cfg.trials):
            self._busy(trial, policy, f"{st.FAIL_BUSY}: every search trial of the budget is taken by the fleet")
            return TrialState.FAIL
        if not self._claim(trial, policy):
            return TrialState.FAIL
        best = control or st.incumbent(study, self._space)
        done = st.search_trials_done(study)
        if role == st.ROLE_SEARCH:
            previous = st.previous_result(study, self._space, policy_key(policy))
            if previous is not None:
                return self._tell_duplicate(trial, policy, previous)
        self._emit(TunerEvent(EventKind.TRIAL_STARTED, trial.number, role, policy, best=best, done=done,
                              total=cfg.trials))

        def progress(stats: WindowStats) -> None:
            self._emit(TunerEvent(EventKind.TRIAL_PROGRESS, trial.number, role, policy, stats=stats, best=best,
                                  done=done, total=cfg.trials))

        # Re-measurements are never pruned: cutting short the one that disagrees with a lucky first
        # measurement would keep exactly the noise they exist to remove.
        prune = role == st.ROLE_SEARCH
        paired = self._against_control.measure(policy, best, progress, lambda: st.beat(trial, self._wall_clock),
                                               prune, cfg.candidate_share)
        m = paired.candidate if isinstance(paired, PairedMeasurement) else paired
        hint = self._hinter.replay(trial, m) if role == st.ROLE_SEARCH else None
        state = self._tell(trial, m, best, paired if isinstance(paired, PairedMeasurement) else None)
        if hint is not None and state is TrialState.COMPLETE:
            self._hinter.enqueue(trial.number, hint)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, role, policy, state.name,
                              m.value if state is not TrialState.FAIL else None, m.stats,
                              st.incumbent(study, self._space), st.search_trials_done(study), cfg.trials,
                              str(trial.user_attrs.get("fail_reason") or trial.user_attrs.get("prune_reason") or ""),
                              paired.ratio if isinstance(paired, PairedMeasurement) else None))
        return state

    def challenge(
        self, params: dict[str, object] | None, incumbent: st.PolicyScore, share: float, prune: bool = True,
        superseded: Callable[[], str | None] = lambda: None,
    ) -> Challenge | None:
        """Continuous mode: one challenger (`params`, or TPE's next proposal when None) beside the
        incumbent at `share` of the traffic, told as a trial of role "challenge" (TPE learns from it;
        it never changes the incumbent by itself). None when TPE proposed a policy already measured
        (its result reused, no traffic spent). `superseded()` is asked at every heartbeat: a reason
        stops the challenge (Superseded)."""

        def heartbeat() -> None:
            st.beat(trial, self._wall_clock)
            reason = superseded()
            if reason:
                raise Superseded(reason)

        if params is not None:
            self._study.enqueue_trial(params, user_attrs={"role": st.ROLE_CHALLENGE})
        trial = self._study.ask()
        with self._interruptions_told(trial):
            trial.set_user_attr("role", st.ROLE_CHALLENGE)
            trial.set_user_attr("tuner_id", self._config.tuner_id)
            st.beat(trial, self._wall_clock)
            policy = self._space.suggest(trial, st.policy_id(self._study.study_name, trial.number))
            if not self._claim(trial, policy):
                return None
            if params is None and (policy_key(policy) == incumbent.key or st.previous_result(
                    self._study, self._space, policy_key(policy)) is not None):
                self._tell_duplicate_challenge(trial, policy, incumbent)
                return None
            self._emit(TunerEvent(EventKind.TRIAL_STARTED, trial.number, st.ROLE_CHALLENGE, policy, best=incumbent))
            measured = self._against_control.measure(policy, incumbent, lambda stats: None, heartbeat, prune, share,
                                                     fresh_control=True)
            paired = measured if isinstance(measured, PairedMeasurement) else None
            m = paired.candidate if paired else measured
            state = self._tell(trial, m, incumbent, paired)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, st.ROLE_CHALLENGE, policy, state.name,
                              m.value if state is not TrialState.FAIL else None, m.stats, incumbent,
                              message=str(trial.user_attrs.get("fail_reason") or trial.user_attrs.get("prune_reason")
                                          or ""), paired=paired.ratio if paired else None))
        return Challenge(trial.number, policy, state, m, paired)

    def _tell_duplicate_challenge(self, trial: optuna.Trial, policy: DraftPolicy, incumbent: st.PolicyScore) -> None:
        previous = st.previous_result(self._study, self._space, policy_key(policy))
        if previous is not None:
            self._tell_duplicate(trial, policy, previous)
            return
        reuse_incumbent(self._study, trial, incumbent)

    def _tell_duplicate(self, trial: optuna.Trial, policy: DraftPolicy, previous: FrozenTrial) -> TrialState:
        """A re-proposal of a measured policy (loop/duplicates.py): its result reused, reported."""
        state, value = reuse_result(self._study, self._space, trial, policy, previous)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, st.ROLE_SEARCH, policy, state.name, value,
                              None, st.incumbent(self._study, self._space), st.search_trials_done(self._study),
                              self._config.trials, f"same policy as trial {previous.number}: result reused"))
        return state

    def _tell(
        self, trial: optuna.Trial, m: Measurement, best: st.PolicyScore | None, paired: PairedMeasurement | None
    ) -> TrialState:
        state = tell_measured(self._study, trial, m, best, paired, self._user_attrs(m.stats), self._config.mode,
                              self._measurer.window, self._measurer.prune)
        if state is TrialState.PRUNED:
            self.apply_incumbent()  # restore at once: this policy is hurting traffic
        return state

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        tell_failed(self._study, trial, reason)
