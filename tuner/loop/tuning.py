"""The online tuning loop: Optuna ask -> apply + measure -> tell, with the incumbent in between.

Contract (what survives what):
- Start: RUNNING trials a killed tuner left behind are told FAIL (`study.recover_interrupted`),
  then the incumbent (best mean over COMPLETE trials) is re-applied, so a restart never leaves the
  server on an abandoned trial policy. Finished trials are never touched.
- Budget: `trials` counts finished, *measured* search trials in the study, so a restarted tuner
  continues to the same total instead of starting over. Interrupted trials do not count (they are
  redone), nor do starved ones, nor re-proposals of an already-measured policy (their result is
  reused, no traffic spent: loop/duplicates.py); `max_consecutive_duplicates` re-proposals in a row
  end the search as converged.
- Comparison (`TrialMode`, measurement/against_control.py): the first trial runs alone and sets the
  scale; every later one is paired with the incumbent as control (same window, traffic split,
  `candidate_share` of the requests) and told `ratio x incumbent value`, or, on a backend that runs
  one policy at a time, measured between two control windows (measurement/interleaved.py).
  Windows last at least `switch_window_factor` x the backend's policy switch time.
- Each trial (loop/tell.py): COMPLETE with the objective, PRUNED (intermediate value reported
  first, so samplers still learn from it) when far worse than the incumbent, or FAIL when the
  window starved. The incumbent is applied after every trial. `max_consecutive_failures` starved
  windows in a row stop the tuner with `NoTraffic` (a diagnosis, not an endless loop of FAILs).
- What-if hint (`whatif_recording`, the server's --record-steps file; loop/whatif_hint.py): after a
  COMPLETE search trial at draft length k > 0 the trial's recorded steps are replayed and the
  predicted best shorter length for the same drafter is enqueued as a search trial.
- End: the best `remeasure_top` policies are measured once more (new trials, role "remeasure",
  never pruned). Sequential: the winner is the lowest mean over all measurements of those. Paired /
  interleaved (the confirmation round): each is paired with one fixed control, the search's
  incumbent, and the winner is the lowest of those direct ratios (the control scoring 1). The winner
  is applied and stored as the study's user attribute "winner" (with the ratios, "confirmation").

The loop lives here; one trial, from ask to tell, is `trial.TrialRunner`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.fleet import Fleet, claim_key, single_worker
from tuner.loop.space import SearchSpace
from tuner.loop.trial import Challenge, TrialRunner
from tuner.loop.tuner_config import TunerConfig
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import Traffic
from tuner.measurement.measure import Measurer, TrialMode
from tuner.measurement.window import WindowStats


class NoTraffic(Exception):
    """Several windows in a row starved: no load, or spans are not reaching the tuner."""


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
        # Other workers on the same study (tuner/loop/fleet.py): policy claims, the shared budget.
        self._fleet = fleet or single_worker(config.tuner_id)
        self._sleep = sleep
        self._storage = storage
        self._space = space
        self._admin = admin
        self._config = config
        self._traffic = traffic
        self._emit = on_event
        self._wall_clock = wall_clock
        self._trials = TrialRunner(study, storage, space, admin, measurer, config, user_attrs, self._fleet,
                                   on_event, wall_clock)

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
            state, number = self._trials.run(st.ROLE_SEARCH)
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
        elsewhere = []
        for candidate in candidates:
            if attempts.get(candidate.key, 0):
                continue  # already re-measured (possibly before a restart)
            if anchor is not None and anchor.key == candidate.key:
                continue  # paired with itself it would measure a ratio of 1: the control needs no re-measure
            if not self._fleet.once(self._study, f"remeasure {claim_key(candidate.key)}"):
                elsewhere.append(candidate.key)  # another worker of the fleet re-measures it
                continue
            self._study.enqueue_trial(
                self._space.params_of(candidate.policy),
                user_attrs={"role": st.ROLE_REMEASURE, "remeasure_of": candidate.trials[0]},
            )
            self._trials.run(st.ROLE_REMEASURE, control=anchor)
            self.apply_incumbent()
        self._wait_for_remeasures(elsewhere)

    def _wait_for_remeasures(self, keys: list) -> None:
        """Until the re-measures other workers took are told: every worker then picks its winner from
        the same trials (a re-measure another worker has claimed but not yet started is invisible to
        `_wait_for_fleet`). A worker that died between its claim and its trial would hold us forever:
        after `stale_seconds` without a result, go on without it."""
        deadline = self._wall_clock() + self._config.stale_seconds
        while keys and self._wall_clock() < deadline:
            told = st.remeasured(self._study, self._space)
            keys = [k for k in keys if not told.get(k, 0)]
            if keys:
                self._recover_stale()
                self._sleep(self._config.fleet_wait_seconds)

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
        return self._trials.apply_incumbent()

    def challenge(
        self, params: dict[str, object] | None, incumbent: st.PolicyScore, share: float, prune: bool = True,
        superseded: Callable[[], str | None] = lambda: None,
    ) -> Challenge | None:
        """Continuous mode's challenger beside the incumbent (`TrialRunner.challenge`)."""
        return self._trials.challenge(params, incumbent, share, prune, superseded)

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
