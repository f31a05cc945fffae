"""`moespec tune --continuous`: the tuner as a background job that never stops on its own.

Contract:
- Start: the epoch's search runs (or resumes) exactly like `moespec tune`; its winner becomes the
  incumbent unless a saved incumbent of the same epoch exists (a restart keeps what was decided).
  Where `moespec tune` would stop (windows starved: no traffic; the server unreachable), continuous
  mode logs it, backs off and resumes the search: it ends only when told to (SIGTERM / the event).
- Then, forever, rounds: one challenger beside the incumbent at `exploration_share` of the traffic
  (a paired trial of role "challenge"), chosen in rotation: plain decoding (the shift probe), the
  runners-up, a fresh TPE proposal. A challenger whose whole confidence interval of cost relative to
  the incumbent lies below 1 - `min_gain` is challenged again at once and promoted when that holds
  in `promote_confirmations` rounds in a row (promotion.PromotionGate). Between rounds the incumbent
  serves alone for an idle time that doubles while nothing changes (cheap when the workload is
  steady) and resets after any decision. On a backend that runs one policy at a time the
  challenger's window had all the traffic, so the idle time is also at least
  window x (1 - share) / share.
- Workload shift (shift.ShiftDetector, from the plain probes and the incumbent's acceptance rate):
  the search re-opens in a fresh study `<study>~<epoch>` (TPE starts without the old workload's
  history) with `reopen_trials` trials, and its winner becomes the incumbent.
- Idle time between rounds is spent in slices of `policy_check_seconds`: the incumbent is re-applied
  where the server lost it (restarted with its start-up policy) and, with several workers on one
  study, the fleet's incumbent (the root study's "continuous" attribute, written by whichever worker
  decided last) is adopted, a re-opened epoch joined. A challenge running when the fleet's
  incumbent changes stops at its next heartbeat (told FAIL "superseded", never counted: its control
  is no longer the incumbent) and the new incumbent is applied at once, so every replica follows a
  fleet decision within about `policy_check_seconds`, mid-challenge or idle.
- State (decisions.py): every decision is appended to the root study's user attribute "decisions",
  the current state is its attribute "continuous" (epoch, incumbent, baselines), logged through
  `on_decision`, and published as the `moespec.tuner.incumbent` gauge. SIGTERM takes the Ctrl-C
  path: the running challenge is told FAIL and the saved incumbent re-applied by the CLI.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import optuna
from optuna.trial import TrialState

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.assemble import Assembled
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.decisions import Decision, detector_from_saved, record, saved_state, score_from_saved
from tuner.loop.fleet import keep
from tuner.loop.metrics import TunerMetrics
from tuner.loop.promotion import PromotionGate
from tuner.loop.shift import ShiftDetector
from tuner.loop.space import SearchSpace, policy_key
from tuner.loop.trial import Challenge, Superseded
from tuner.loop.tuning import NoTraffic
from tuner.measurement.admin import ServerUnavailable


def idle_floor(c: Challenge | None, share: float) -> float:
    """Where the challenger had all the traffic for its window (a backend that runs one policy at a
    time: interleaved windows), the incumbent then serves alone long enough that the challenger got
    at most `share` of the time. Nothing to add after a split window: the split already bounds it."""
    if c is None or (c.paired is not None and c.paired.share == share):
        return 0.0
    return c.measurement.seconds * (1.0 - share) / share


def epoch_study_name(root: str, epoch: int) -> str:
    return root if epoch == 0 else f"{root}~{epoch}"


class ContinuousTuner:
    def __init__(
        self,
        root: optuna.Study,
        make: Callable[[str, int], Assembled],
        config: ContinuousConfig,
        initial_trials: int,
        metrics: TunerMetrics | None = None,
        on_decision: Callable[[Decision], None] = lambda d: None,
        on_log: Callable[[str], None] = lambda line: None,
        on_round: Callable[[float, float, float], None] = lambda start, end, floor: None,
    ):
        self._root = root
        self._make = make
        self._config = config
        self._initial_trials = initial_trials
        self._metrics = metrics
        self._on_decision = on_decision
        self._on_log = on_log  # waiting for traffic / the server (not decisions: nothing was decided)
        self._on_round = on_round  # each challenge round: monotonic start and end, its idle floor (s)
        self._stop = threading.Event()
        self.built: Assembled | None = None
        self.incumbent: st.PolicyScore | None = None
        self.epoch = int(saved_state(root).get("epoch", 0))
        self.detector = ShiftDetector(config)
        self.gate = PromotionGate(config.promote_confirmations)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        if not self._open_epoch(self.epoch, resumed=True):
            return  # stopped while waiting for traffic
        rounds = 0
        idle = self._config.idle_seconds
        while not stop.is_set():
            challenger = self._next_challenger(rounds)
            rounds += 1
            # The plain probe is never pruned: plain far worse than the incumbent is the normal case,
            # and its ratio is what the shift detector needs (its cost is bounded by the share).
            probe = challenger is not None and challenger.get("draft_length") == 0
            started = time.monotonic()
            try:
                result = self.built.tuner.challenge(challenger, self.incumbent, self._config.exploration_share,
                                                    prune=not probe, superseded=self._fleet_moved)
            except Superseded as e:
                self._on_log(f"challenge stopped: {e}")
                self._adopt_fleet_incumbent()
                self._keep(self._config.idle_seconds)
                continue
            except ServerUnavailable as e:
                # A background job outlives server restarts: wait (backing off) and try again.
                idle = min(self._config.max_idle_seconds, idle * 2)
                self._on_log(f"server unreachable ({e}); next challenge in {idle:.0f} s")
                self._keep(idle)
                continue
            decided = self._judge(result) if result is not None else False
            self.restore()
            floor = idle_floor(result, self._config.exploration_share)
            self._on_round(started, time.monotonic(), floor)
            idle = self._config.idle_seconds if decided else min(self._config.max_idle_seconds, idle * 2)
            self._keep(max(idle, floor))

    def _keep(self, seconds: float) -> None:
        """Idle time: the incumbent stays on the server (re-applied after a restart) and follows the
        fleet's incumbent in the study (tuner/loop/fleet.py)."""
        def reapplied(after: float) -> None:
            self._on_log(f"the server had lost the incumbent (restarted?): {self.incumbent.key.label()} "
                         f"({self.incumbent.policy.policy_id}) re-applied {after:.1f} s after it was last in place")

        keep(self._stop, seconds, self._config.policy_check_seconds,
             ensure=lambda: self.built.tuner.ensure(self.incumbent.policy), on_reapplied=reapplied,
             adopt=self._adopt_fleet_incumbent)

    def _fleet_moved(self, saved: dict | None = None) -> str | None:
        """What the fleet decided (`saved`: the root study's state, read when not given) that this
        worker has not followed yet; None: nothing."""
        saved = saved_state(self._root) if saved is None else saved
        theirs = saved.get("incumbent")
        if not theirs or self.incumbent is None:
            return None
        epoch = int(saved.get("epoch", 0))
        if epoch > self.epoch:
            return f"another worker re-opened the search (epoch {epoch})"
        if epoch < self.epoch or theirs["policy_id"] == self.incumbent.policy.policy_id:
            return None
        return f"the fleet's incumbent is now {theirs.get('label', '?')} ({theirs['policy_id']})"

    def _adopt_fleet_incumbent(self) -> None:
        """Several workers on one study: whichever promoted last wrote the incumbent to the root
        study's "continuous" attribute; every worker runs that one (and joins a re-opened search)."""
        saved = saved_state(self._root)
        if self._fleet_moved(saved) is None:
            return
        epoch = int(saved.get("epoch", 0))
        if epoch > self.epoch:
            self._on_log(f"another worker re-opened the search (epoch {epoch}): joining it")
            self._open_epoch(epoch, resumed=True)
            return
        theirs = saved["incumbent"]
        self.incumbent = score_from_saved(self.built.space, theirs)
        self.gate = PromotionGate(self._config.promote_confirmations)
        self.detector = detector_from_saved(self._config, saved)
        self._on_log(f"fleet incumbent adopted: {self.incumbent.key.label()} ({self.incumbent.policy.policy_id})")
        self.restore()

    def _search(self) -> st.PolicyScore | None:
        """The epoch's search, resumed until it finishes. Starved windows (no traffic yet, or spans not
        arriving) and an unreachable server do not end continuous mode: it logs, backs off (doubling
        from `idle_seconds` up to `max_idle_seconds`) and resumes the same study, whose starved
        trials do not count towards its budget. None only when stopped meanwhile."""
        wait = self._config.idle_seconds
        while not self._stop.is_set():
            try:
                return self.built.tuner.run()
            except (NoTraffic, ServerUnavailable) as e:
                what = "no traffic" if isinstance(e, NoTraffic) else "server unreachable"
                self._on_log(f"search of epoch {self.epoch} waiting: {what} ({e}); retrying in {wait:.0f} s")
                self._stop.wait(wait)
                wait = min(self._config.max_idle_seconds, wait * 2)
        return None

    def restore(self) -> None:
        """Put the incumbent back as the only policy (after a challenge, an interruption, at start)."""
        if self.incumbent is not None and self.built is not None:
            self.built.tuner.apply(self.incumbent.policy)

    def _judge(self, c: Challenge) -> bool:
        """Promote, re-open or keep; True when something was decided (the idle time resets)."""
        if c.state is not TrialState.COMPLETE or c.paired is None:
            self._decide("kept", f"challenger {policy_key(c.policy).label()} {c.state.name.lower()}")
            return False
        ratio = c.paired.ratio
        shift = None
        if c.policy.draft_length == 0 and self.incumbent.policy.draft_length > 0:
            shift = self.detector.observe_plain_probe(ratio.ratio, ratio.low, ratio.high)
        if shift is None and self.incumbent.policy.draft_length > 0:
            shift = self.detector.observe_acceptance(c.paired.control.acceptance_rate, c.paired.control.drafted)
        if shift is not None:
            self._reopen(shift)
            return True
        better = ratio.high < 1.0 - self._config.min_gain
        measured = (f"{ratio.ratio:.3f}x the incumbent's (95% interval {ratio.low:.3f}-{ratio.high:.3f}) over "
                    f"{ratio.candidate_requests} + {ratio.control_requests} requests")
        if self.gate.observe(c.policy, better):
            self._promote(c, f"cost {measured}, better with confidence in {self.gate.confirmations} rounds in a row")
            return True
        label = policy_key(c.policy).label()
        if better:  # pending: challenged again in the next round, which comes soon (the idle time resets)
            self._decide("kept", f"challenger {label} at {measured}: better with confidence, "
                                 f"{self.gate.wins} of {self.gate.confirmations} rounds; measured again next")
            return True
        self._decide("kept", f"challenger {label} at {ratio.ratio:.3f}x ({ratio.low:.3f}-{ratio.high:.3f}): "
                             "not better with confidence")
        return False

    # -- decisions ---------------------------------------------------------------------------

    def _open_epoch(self, epoch: int, resumed: bool) -> bool:
        """Run (or resume) the epoch's search and set the incumbent; False when stopped meanwhile."""
        self.epoch = epoch
        name = epoch_study_name(self._root.study_name, epoch)
        self.built = self._make(name, self._initial_trials if epoch == 0 else self._config.reopen_trials)
        winner = self._search()
        if self._stop.is_set():
            return False
        saved = saved_state(self._root)
        kept = saved.get("incumbent") if resumed and saved.get("epoch") == epoch else None
        self.detector = ShiftDetector(self._config)
        self.gate = PromotionGate(self._config.promote_confirmations)
        if kept is not None:
            self.incumbent = score_from_saved(self.built.space, kept)
            self.detector = detector_from_saved(self._config, saved)
            self._decide("initial", "restarted: the saved incumbent is kept")
        elif winner is not None:
            self.incumbent = winner
            self._baseline_from_study()
            self._decide("initial", f"epoch {epoch}: the search's winner")
        else:
            raise RuntimeError("the search finished without a single complete trial")
        self.restore()
        return True

    def _reopen(self, reason: str) -> None:
        self._decide("reopen", reason)
        self._open_epoch(self.epoch + 1, resumed=False)

    def _promote(self, c: Challenge, reason: str) -> None:
        value = c.measurement.value
        self.incumbent = st.PolicyScore(policy_key(c.policy), c.policy, value, (value,), (c.trial,))
        self.gate = PromotionGate(self._config.promote_confirmations)
        # New incumbent, new baselines: the next probes measure against it.
        self.detector = ShiftDetector(self._config, acceptance=c.measurement.stats.acceptance_rate
                                      if c.measurement.stats.drafted >= self._config.min_drafted_for_acceptance
                                      else None)
        self._decide("promote", reason)

    def _baseline_from_study(self) -> None:
        """The acceptance baseline from the winner's own window; the plain baseline is left to the
        probes (see ShiftDetector)."""
        trial = self.built.study.get_trials(deepcopy=False)[self.incumbent.trials[0]]
        if int(trial.user_attrs.get("drafted_tokens", 0)) >= self._config.min_drafted_for_acceptance:
            self.detector.acceptance = float(trial.user_attrs.get("acceptance_rate", 0.0))

    def _decide(self, kind: str, reason: str) -> None:
        inc = self.incumbent
        d = Decision(kind, inc.key.label(), inc.policy.policy_id, inc.mean, self.epoch, reason)
        record(self._root, d, self.built.space, inc, self.detector, self._config.max_decisions)
        if self._metrics is not None:
            self._metrics.decision(kind)
            self._metrics.incumbent(inc.policy.policy_id, inc.key.label(), inc.mean, self.epoch)
        self._on_decision(d)

    # -- who challenges ----------------------------------------------------------------------

    def _next_challenger(self, rounds: int) -> dict[str, object] | None:
        """Params of the next challenger, or None for a fresh TPE proposal."""
        space: SearchSpace = self.built.space
        if self.gate.pending is not None:
            return space.params_of(self.gate.pending)
        speculating = self.incumbent.policy.draft_length > 0
        if speculating and rounds % self._config.probe_plain_every == 0:
            return space.params_of(DraftPolicy(draft_length=0))
        if rounds % 2 == 1:
            runners = [s for s in st.scores(self.built.study, space) if s.key != self.incumbent.key]
            runners = runners[: self._config.runners_up]
            if runners:
                pick = runners[(rounds // 2) % len(runners)]
                return space.params_of(replace(pick.policy))
        return None
