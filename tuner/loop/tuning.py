"""The online tuning loop: Optuna ask -> apply + measure -> tell, with the incumbent in between.

Contract (what survives what):
- Start: RUNNING trials a killed tuner left behind are told FAIL (`study.recover_interrupted`),
  then the incumbent (best mean over COMPLETE trials) is re-applied, so a restart never leaves the
  server on an abandoned trial policy. Finished trials are never touched.
- Budget: `trials` counts finished, *measured* search trials in the study, so a restarted tuner
  continues to the same total instead of starting over. Interrupted trials do not count (they are
  redone), nor do starved ones, nor re-proposals of an already-measured policy (their result is reused, no traffic
  spent); `max_consecutive_duplicates` re-proposals in a row end the search as converged.
- Comparison (`TrialMode`): the first trial runs alone and sets the scale; every later one is
  paired with the incumbent as control (same window, traffic split, `candidate_share` of the
  requests) and told `ratio x incumbent value`, or, on a backend that runs one policy at a time,
  measured between two control windows (the trailing one is the next trial's leading one).
  Windows last at least `switch_window_factor` x the backend's policy switch time.
- Each trial: COMPLETE with the objective, PRUNED (intermediate value reported first, so samplers
  still learn from it) when far worse than the incumbent, or FAIL when the window starved. The
  incumbent is applied after every trial. `max_consecutive_failures` starved windows in a row stop
  the tuner with `NoTraffic` (a diagnosis, not an endless loop of FAILs).
- What-if hint (`whatif_recording`, the server's --record-steps file): after a COMPLETE search trial
  at draft length k > 0, that trial's recorded steps (its policy id is unique) are replayed
  (service/whatif/hint.py); the prediction for every k' <= k is stored in the trial's user
  attributes and the predicted best shorter length for the same drafter is enqueued as a search
  trial, unless that policy is already measured or queued. A missing or unreadable recording is
  logged (event WHATIF, attribute `whatif_error`) and the search goes on without the hint.
- End: the best `remeasure_top` policies are measured once more (new trials, role "remeasure",
  never pruned). Sequential: the winner is the lowest mean over all measurements of those. Paired /
  interleaved (the confirmation round): each is paired with one fixed control, the search's
  incumbent, and the winner is the lowest of those direct ratios (the control scoring 1). The winner
  is applied and stored as the study's user attribute "winner" (with the ratios, "confirmation").
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from service.types import DraftPolicy
from service.whatif.hint import LengthHint, hint_from_prediction, prediction_attributes, replay_trial, user_attributes
from tuner.loop import study as st
from tuner.loop.fleet import Fleet, claim_key, single_worker
from tuner.loop.space import PolicyKey, SearchSpace, policy_key
from tuner.measurement.admin import AdminRejected, PolicyAdmin, ServerUnavailable
from tuner.measurement.collector import Traffic
from tuner.measurement.measure import Measurement, Measurer, Outcome, PairedMeasurement, TrialMode
from tuner.measurement.paired import PairedRatio, drift_log_variance
from tuner.measurement.window import WindowSpec, WindowStats


class NoTraffic(Exception):
    """Several windows in a row starved: no load, or spans are not reaching the tuner."""


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


class EventKind(enum.StrEnum):
    RESUMED = "resumed"
    INCUMBENT = "incumbent"
    TRIAL_STARTED = "trial_started"
    TRIAL_PROGRESS = "trial_progress"
    TRIAL_FINISHED = "trial_finished"
    CONVERGED = "converged"
    WINNER = "winner"
    WHATIF = "whatif"  # a what-if hint was enqueued, skipped, or could not be computed (message says which)


@dataclass(frozen=True)
class TunerEvent:
    kind: EventKind
    trial: int | None = None
    role: str = ""
    policy: DraftPolicy | None = None
    state: str = ""  # COMPLETE / PRUNED / FAIL for TRIAL_FINISHED
    value: float | None = None
    stats: WindowStats | None = None
    best: st.PolicyScore | None = None
    done: int = 0  # finished search trials
    total: int = 0
    message: str = ""
    paired: PairedRatio | None = None  # for TRIAL_FINISHED of a paired / interleaved trial


@dataclass(frozen=True)
class Challenge:
    trial: int
    policy: DraftPolicy
    state: TrialState
    measurement: Measurement
    paired: PairedMeasurement | None  # None when it ran alone (sequential mode)


class Tuner:
    def __init__(
        self,
        study: optuna.Study,
        storage: optuna.storages.BaseStorage,
        space: SearchSpace,
        admin: PolicyAdmin,
        measurer: Measurer,
        config: TunerConfig,
        user_attrs: Callable[[WindowStats], dict[str, object]],
        traffic: Callable[[], Traffic],
        on_event: Callable[[TunerEvent], None] = lambda e: None,
        wall_clock: Callable[[], float] = time.time,
        fleet: Fleet | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._study = study
        # Other workers on the same study (tuner/fleet.py): policy claims, the shared budget.
        self._fleet = fleet or single_worker(config.tuner_id)
        self._sleep = sleep
        self._claimed: tuple[int, PolicyKey] | None = None
        self._storage = storage
        self._space = space
        self._admin = admin
        self._measurer = measurer
        self._config = config
        self._user_attrs = user_attrs
        self._traffic = traffic
        self._emit = on_event
        self._wall_clock = wall_clock
        # INTERLEAVED: the last trial's trailing control window, reusable as the next leading one
        self._last_control: tuple[PolicyKey, WindowStats] | None = None

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> st.PolicyScore | None:
        cfg, study = self._config, self._study
        # Fail fast, before touching the study, on an unreachable server or a refused admin token.
        self._admin.current()
        recovered = st.recover_interrupted(
            self._storage, study, cfg.tuner_id, cfg.stale_seconds, self._wall_clock()
        )
        done = st.search_trials_done(study)
        self._emit(TunerEvent(EventKind.RESUMED, done=done, total=cfg.trials,
                              message=f"{len(study.trials)} trials stored, {len(recovered)} interrupted marked FAIL"
                              + (f" ({', '.join(map(str, recovered))})" if recovered else "")))
        self.apply_incumbent()
        if not study.trials and self._fleet.once(study, "initial-design"):
            for policy in cfg.initial_policies[: cfg.trials]:
                study.enqueue_trial(self._space.params_of(policy), user_attrs={"role": st.ROLE_SEARCH})
        failures = duplicates = 0
        while st.search_trials_done(study) < cfg.trials:
            if self._budget_taken_elsewhere():
                continue
            state, number = self._run_trial(st.ROLE_SEARCH)
            attrs = study.get_trials(deepcopy=False)[number].user_attrs
            if str(attrs.get("fail_reason", "")).startswith(st.FAIL_BUSY):
                self._sleep(cfg.fleet_wait_seconds)  # another worker has that policy: ask again
                continue
            failures = failures + 1 if state is TrialState.FAIL else 0
            reused = "duplicate_of" in attrs
            duplicates = duplicates + 1 if reused else 0
            self.apply_incumbent()
            if failures >= cfg.max_consecutive_failures:
                raise NoTraffic(self._diagnose(failures))
            if duplicates >= cfg.max_consecutive_duplicates:
                self._emit(TunerEvent(EventKind.CONVERGED, done=st.search_trials_done(study), total=cfg.trials,
                                      message=f"{duplicates} re-proposals of measured policies in a row"))
                break
        self._wait_for_fleet((st.ROLE_SEARCH,))  # the candidates include the other workers' last trials
        self._remeasure()
        self._wait_for_fleet((st.ROLE_REMEASURE,))  # one winner for the whole fleet
        return self._finish()

    def _recover_stale(self) -> list[int]:
        return st.recover_interrupted(self._storage, self._study, self._config.tuner_id,
                                      self._config.stale_seconds, self._wall_clock())

    def _budget_taken_elsewhere(self) -> bool:
        """Fleet: the budget's remaining trials are all running on other workers. Wait (failing any
        whose worker died: no heartbeat for `stale_seconds`) instead of overshooting the budget."""
        self._recover_stale()
        running = self._fleet.in_flight_elsewhere(self._study)
        if running and st.search_trials_done(self._study) + running >= self._config.trials:
            self._sleep(self._config.fleet_wait_seconds)
            return True
        return False

    def _wait_for_fleet(self, roles: tuple[str, ...]) -> None:
        while self._fleet.in_flight_elsewhere(self._study, roles):
            self._recover_stale()
            self._sleep(self._config.fleet_wait_seconds)

    def _remeasure(self) -> None:
        """Sequential: the best `remeasure_top` policies measured once more. Paired / interleaved: the
        confirmation round. The search's incumbent (best by search trials only, so the same after a
        restart) is the one control; every other top policy is paired with it, and the winner is
        picked by those direct ratios (`study.confirmed_winner`). Why one fixed control: during the
        search each value is `ratio x its control's value`, a chain through every incumbent change,
        and each link's noise is selected for (a lucky ratio makes the next incumbent), so the
        chained values drift low; a direct comparison in the same windows has no chain."""
        attempts = st.remeasured(self._study, self._space)
        candidates = st.remeasure_candidates(self._study, self._space, self._config.remeasure_top)
        paired = self._config.mode is not TrialMode.SEQUENTIAL
        anchor = candidates[0] if paired and candidates else None
        for candidate in candidates:
            if attempts.get(candidate.key, 0):
                continue  # already re-measured (possibly before a restart)
            if anchor is not None and anchor.key == candidate.key:
                continue  # paired with itself it would measure a ratio of 1: the control needs no re-measure
            if not self._fleet.once(self._study, f"remeasure {claim_key(candidate.key)}"):
                continue  # another worker of the fleet re-measures it
            self._study.enqueue_trial(
                self._space.params_of(candidate.policy),
                user_attrs={"role": st.ROLE_REMEASURE, "remeasure_of": candidate.trials[0]},
            )
            self._run_trial(st.ROLE_REMEASURE, control=anchor)
            self.apply_incumbent()

    def _finish(self) -> st.PolicyScore | None:
        if self._config.mode is TrialMode.SEQUENTIAL:
            best, confirmation = st.winner(self._study, self._space, self._config.remeasure_top), None
        else:
            best, confirmation = st.confirmed_winner(self._study, self._space, self._config.remeasure_top)
        if best is None:
            return None
        self._admin.apply(best.policy)
        self._study.set_user_attr(
            "winner",
            {
                "policy": best.key.label(),
                "params": self._space.params_of(best.policy),
                "policy_id": best.policy.policy_id,
                "mean": best.mean,
                "values": list(best.values),
                "trials": list(best.trials),
                **({"confirmation": confirmation} if confirmation else {}),
            },
        )
        self._emit(TunerEvent(EventKind.WINNER, policy=best.policy, value=best.mean, best=best,
                              done=st.search_trials_done(self._study), total=self._config.trials))
        return best

    def apply(self, policy: DraftPolicy) -> None:
        self._admin.apply(policy)

    def ensure(self, policy: DraftPolicy) -> bool:
        """Re-apply `policy` where the server runs another one (it restarted); True when it had to."""
        return self._admin.ensure(policy)

    def apply_incumbent(self) -> st.PolicyScore | None:
        best = st.incumbent(self._study, self._space)
        if best is not None:
            self._admin.apply(best.policy)
            self._emit(TunerEvent(EventKind.INCUMBENT, policy=best.policy, value=best.mean, best=best))
        return best

    # -- one trial ---------------------------------------------------------------------------

    def _run_trial(self, role: str, control: st.PolicyScore | None = None) -> tuple[TrialState, int]:
        """`control`: the paired control arm (default: the incumbent)."""
        trial = self._study.ask()
        try:
            return self._run_asked(trial, role, control), trial.number
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker took this one for dead (no heartbeat for stale_seconds: a stalled machine)
            # and failed it: its result is lost, not counted, and the search goes on.
            return TrialState.FAIL, trial.number
        except ServerUnavailable as e:
            self._fail(trial, f"{st.FAIL_UNREACHABLE}: {e}")
            raise
        except AdminRejected:
            self._fail(trial, "admin token refused")
            raise
        except BaseException:
            # Ctrl-C / SIGTERM (or a bug): the bookkeeping a restart would do, done now.
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
        reason = f"{st.FAIL_BUSY}: {key.label()} is being measured by {holder}"
        self._fail(trial, reason)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, str(trial.user_attrs.get("role", "")), policy,
                              TrialState.FAIL.name, message=f"{reason}; not counted, asking again"))
        return False

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
        paired = self.measure_against(policy, best, progress, lambda: st.beat(trial, self._wall_clock), prune,
                                      cfg.candidate_share)
        m = paired.candidate if isinstance(paired, PairedMeasurement) else paired
        hint = self._whatif_hint(trial, m) if role == st.ROLE_SEARCH else None
        state = self._tell(trial, m, best, paired if isinstance(paired, PairedMeasurement) else None)
        if hint is not None and state is TrialState.COMPLETE:
            self._enqueue_hint(trial.number, hint)
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, role, policy, state.name,
                              m.value if state is not TrialState.FAIL else None, m.stats,
                              st.incumbent(study, self._space), st.search_trials_done(study), cfg.trials,
                              str(trial.user_attrs.get("fail_reason") or trial.user_attrs.get("prune_reason") or ""),
                              paired.ratio if isinstance(paired, PairedMeasurement) else None))
        return state

    def _whatif_hint(self, trial: optuna.Trial, m: Measurement) -> LengthHint | None:
        """Replay the trial's recorded steps (before it is told: user attributes need a running trial).
        The hint is advisory: a recording that is missing, unreadable or malformed is logged and
        stored as `whatif_error`, never raised."""
        path, policy = self._config.whatif_recording, m.policy
        if path is None or m.outcome is not Outcome.COMPLETE or policy.draft_length == 0:
            return None
        try:
            # The window's minimum of steps is what the trial itself was measured on.
            result = replay_trial(path, policy, min_steps=self._measurer.window.min_steps)
        except (OSError, ValueError, KeyError, ArithmeticError) as e:  # RecordingError is a ValueError
            reason = f"{type(e).__name__}: {e}"
            trial.set_user_attr("whatif_error", reason)
            self._emit(TunerEvent(EventKind.WHATIF, trial.number, policy=policy, message=f"no hint: {reason}"))
            return None
        if result is None:
            trial.set_user_attr("whatif_error", f"fewer than {self._measurer.window.min_steps} recorded steps "
                                                f"under {policy.policy_id} in {path}")
            return None
        hint = hint_from_prediction(result, policy, self._config.whatif_margin)
        for key, value in (user_attributes(hint) if hint else prediction_attributes(result, policy)).items():
            trial.set_user_attr(key, value)
        return hint

    def _enqueue_hint(self, number: int, hint: LengthHint) -> None:
        """Queue the predicted best shorter length as a search trial, unless already measured or queued."""
        study, key = self._study, policy_key(hint.suggested)
        previous = st.previous_result(study, self._space, key)
        pending = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
                        if policy_key(self._space.policy_from_params(
                            t.system_attrs.get("fixed_params", t.params), "")) == key), None)
        predicted = f"{key.label()} predicted {hint.predicted_best * 1e3:.3f} ms/tok"
        if previous is not None or pending is not None:
            why = f"measured in trial {previous.number}" if previous is not None else "already queued"
            self._emit(TunerEvent(EventKind.WHATIF, number, policy=hint.suggested, message=f"{predicted}: {why}"))
            return
        study.enqueue_trial(self._space.params_of(hint.suggested),
                            user_attrs={"role": st.ROLE_SEARCH, "whatif_of": number})
        self._emit(TunerEvent(EventKind.WHATIF, number, policy=hint.suggested, message=f"{predicted}: enqueued"))

    def measure_against(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore | None,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        prune: bool,
        share: float,
    ) -> Measurement | PairedMeasurement:
        """Measure `policy` the configured way against `control` (alone when there is none yet)."""
        mode, window = self._config.mode, self.window()
        if control is None or mode is TrialMode.SEQUENTIAL or control.key == policy_key(policy):
            self._last_control = None
            prune_against = control.mean if control is not None and prune else None
            return self._measurer.measure(policy, prune_against, progress, heartbeat, window)
        control_policy = replace(control.policy, policy_id=f"{policy.policy_id}/control")
        if mode is TrialMode.PAIRED:
            self._last_control = None
            return self._measurer.measure_paired(policy, control_policy, share, control.mean, progress, heartbeat,
                                                 window, prune)
        return self._measure_interleaved(policy, control, progress, heartbeat, window, prune)

    def _measure_interleaved(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        window: WindowSpec,
        prune: bool,
    ) -> PairedMeasurement:
        """Control, candidate, control: three windows, two policy switches, and the trailing control
        window is kept for the next trial's leading one (two switches per trial in a run). The ratio's
        interval also carries the drift the two control windows show (paired.drift_log_variance)."""
        measure = self._measurer.measure
        reused, self._last_control = self._last_control, None
        if reused is not None and reused[0] == control.key:
            lead = reused[1]
        else:
            before = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-before"), None, None,
                             heartbeat, window)
            if before.outcome is not Outcome.COMPLETE:
                m = Measurement(policy, Outcome.STARVED, WindowStats(policy.policy_id), float("inf"), before.seconds,
                                before.reapplied, before.other_spans)
                return PairedMeasurement(m, before.stats, control.policy, PairedRatio.of(m.stats, before.stats), 0.5)
            lead = before.stats
        cand = measure(policy, lead.seconds_per_token if prune else None, progress, heartbeat, window)
        if cand.outcome is Outcome.PRUNED:
            cand, lead = self._recheck_prune(policy, control, cand, lead, progress, heartbeat, window)
        controls, drift = lead.copy(), 0.0
        if cand.outcome is Outcome.COMPLETE:
            after = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-after"), None, None,
                            heartbeat, window)
            if after.outcome is Outcome.COMPLETE:
                controls.merge(after.stats)
                drift = drift_log_variance(lead, after.stats)
                self._last_control = (control.key, after.stats)
        ratio = PairedRatio.of(cand.stats, controls, extra_log_variance=drift)
        m = replace(cand, value=ratio.ratio * control.mean) if cand.stats.committed else cand
        return PairedMeasurement(m, controls, control.policy, ratio, 0.5)

    def _recheck_prune(
        self,
        policy: DraftPolicy,
        control: st.PolicyScore,
        cand: Measurement,
        lead: WindowStats,
        progress: Callable[[WindowStats], None],
        heartbeat: Callable[[], None],
        window: WindowSpec,
    ) -> tuple[Measurement, WindowStats]:
        """An interleaved prune compares the candidate with a control window measured before it: a
        machine that slowed down in between (another tenant, a burst) prunes a good candidate, and a
        pruned policy is never measured again (duplicates reuse its result). So a control window as
        long as the candidate's runs right after it; the prune stands only if the candidate is still
        over the factor against that one. Otherwise the candidate is measured once more from the
        start against the fresh control, which becomes the lead window."""
        measure = self._measurer.measure
        size = replace(window, min_tokens=max(1, cand.stats.committed), min_steps=max(1, cand.stats.steps),
                       min_seconds=0.0)
        check = measure(replace(control.policy, policy_id=f"{policy.policy_id}/control-check"), None, None,
                        heartbeat, size)
        factor = self._measurer.prune.factor
        if check.outcome is not Outcome.COMPLETE or \
                cand.stats.seconds_per_token > factor * check.stats.seconds_per_token:
            return cand, lead
        again = measure(policy, check.stats.seconds_per_token, progress, heartbeat, window)
        return again, check.stats

    def window(self) -> WindowSpec:
        """The trial window, stretched where a policy switch is expensive: every window lasts at
        least `switch_window_factor` x the backend's last measured switch, so switching costs at most
        ~1/factor of the time spent measuring."""
        base = self._measurer.window
        factor = self._config.switch_window_factor
        switch = self._admin.model_info().policy_switch_seconds if factor > 0 else 0.0
        if switch <= 0:
            return base
        floor = factor * switch
        return replace(base, min_seconds=max(base.min_seconds, floor), max_seconds=base.max_seconds + floor)

    def challenge(
        self, params: dict[str, object] | None, incumbent: st.PolicyScore, share: float, prune: bool = True
    ) -> Challenge | None:
        """Continuous mode: one challenger (`params`, or TPE's next proposal when None) beside the
        incumbent at `share` of the traffic, told as a trial of role "challenge" (TPE learns from it;
        it never changes the incumbent by itself). None when TPE proposed a policy already measured
        (its result reused, no traffic spent)."""
        if params is not None:
            self._study.enqueue_trial(params, user_attrs={"role": st.ROLE_CHALLENGE})
        trial = self._study.ask()
        try:
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
            measured = self.measure_against(policy, incumbent, lambda stats: None,
                                            lambda: st.beat(trial, self._wall_clock), prune, share)
            paired = measured if isinstance(measured, PairedMeasurement) else None
            m = paired.candidate if paired else measured
            state = self._tell(trial, m, incumbent, paired)
        except ServerUnavailable as e:
            self._fail(trial, f"{st.FAIL_UNREACHABLE}: {e}")
            raise
        except BaseException:
            self._fail(trial, st.FAIL_INTERRUPTED)
            raise
        finally:
            self._release_claim()
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
        trial.set_user_attr("duplicate_of", incumbent.trials[0])  # TPE proposed the incumbent itself
        self._study.tell(trial, incumbent.mean)

    def _tell_duplicate(self, trial: optuna.Trial, policy: DraftPolicy, previous: FrozenTrial) -> TrialState:
        """The sampler asked for a policy already measured: reuse that result instead of spending
        traffic on it (noise is handled by pairing and the re-measure phase, not by random repeats).
        It does not count towards --trials; `max_consecutive_duplicates` in a row end the search."""
        for key, value in previous.user_attrs.items():
            if key not in ("role", "tuner_id", "heartbeat", "whatif_of"):  # a copy was not queued by a hint
                trial.set_user_attr(key, value)
        trial.set_user_attr("duplicate_of", previous.number)
        if previous.state is TrialState.COMPLETE:
            score = next((s for s in st.scores(self._study, self._space) if s.key == policy_key(policy)), None)
            value = score.mean if score is not None else float(previous.value)  # a challenge-only policy
            self._study.tell(trial, value)
            state = TrialState.COMPLETE
        else:
            step, value = max(previous.intermediate_values.items()) if previous.intermediate_values else (0, None)
            if value is not None:
                trial.report(value, step=step)
            self._study.tell(trial, state=TrialState.PRUNED)
            state = TrialState.PRUNED
        self._emit(TunerEvent(EventKind.TRIAL_FINISHED, trial.number, st.ROLE_SEARCH, policy, state.name, value,
                              None, st.incumbent(self._study, self._space), st.search_trials_done(self._study),
                              self._config.trials, f"same policy as trial {previous.number}: result reused"))
        return state

    def _tell(
        self, trial: optuna.Trial, m: Measurement, best: st.PolicyScore | None, paired: PairedMeasurement | None
    ) -> TrialState:
        for key, value in self._user_attrs(m.stats).items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("trial_mode", self._config.mode.value if paired else TrialMode.SEQUENTIAL.value)
        if paired is not None:
            for key, value in paired.ratio.as_attrs().items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("control_policy", policy_key(paired.control_policy).label())
            trial.set_user_attr("control_value", best.mean if best else None)
            trial.set_user_attr("control_seconds_per_token",
                                paired.control.seconds_per_token if paired.control.committed else None)
            trial.set_user_attr("candidate_share", paired.share)
        trial.set_user_attr("window_seconds", round(m.seconds, 3))
        trial.set_user_attr("policy_reapplied", m.reapplied)
        window = self._measurer.window
        if m.outcome is Outcome.COMPLETE:
            self._study.tell(trial, m.value)
            return TrialState.COMPLETE
        if m.outcome is Outcome.PRUNED:
            trial.report(m.value, step=m.stats.committed)
            against = "incumbent" if paired is None or self._config.mode is TrialMode.PAIRED else "control window"
            trial.set_user_attr(
                "prune_reason",
                f"running cost {m.value:.4g} > {self._measurer.prune.factor} x {against} {best.mean:.4g} "
                f"after {m.stats.committed} tokens",
            )
            self._study.tell(trial, state=TrialState.PRUNED)
            self.apply_incumbent()  # restore at once: this policy is hurting traffic
            return TrialState.PRUNED
        self._fail(
            trial,
            f"{st.FAIL_STARVED}: {m.stats.committed} tokens / {m.stats.steps} steps / {m.stats.requests} requests in "
            f"{m.seconds:.1f} s (need {window.min_tokens} tokens and {window.min_steps} steps; "
            f"{m.other_spans} spans of other policies arrived meanwhile)",
        )
        return TrialState.FAIL

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        try:
            trial.set_user_attr("fail_reason", reason)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # interrupted after it was told: its result stands
        self._study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    def _diagnose(self, failures: int) -> str:
        t = self._traffic()
        if t.request_spans == 0:
            hint = ("no request spans reached the tuner at all: point the server's OTEL_EXPORTER_OTLP_ENDPOINT "
                    "(or its Collector) at --otlp-listen, and check the server has traffic")
        elif t.unwatched_spans == t.request_spans:
            hint = "spans arrive, but none for the tuner's policy ids: is another tuner or operator setting policies?"
        else:
            hint = "too little traffic for the window: add load or lower --min-tokens / raise --max-window-seconds"
        return f"{failures} trial windows in a row starved; {hint}"
