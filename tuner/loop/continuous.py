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
  in `promote_confirmations` rounds in a row (PromotionGate). Between rounds the incumbent serves alone for
  an idle time that doubles while nothing changes (cheap when the workload is steady) and resets
  after any decision. On a backend that runs one policy at a time the challenger's window had all
  the traffic, so the idle time is also at least window x (1 - share) / share.
- Workload shift (`ShiftDetector`): the incumbent's cost relative to plain decoding (pooled over the
  plain probes since it was chosen) moves by more than `plain_shift` with the old value outside the
  new interval, or the incumbent's acceptance rate moves by more than `acceptance_shift`, in
  `confirmations` consecutive windows. Then the search
  re-opens: a fresh study `<study>~<epoch>` (TPE starts without the old workload's history) with
  `reopen_trials` trials, and its winner becomes the incumbent.
- Idle time between rounds is spent in slices of `policy_check_seconds`: the incumbent is re-applied
  where the server lost it (restarted with its start-up policy) and, with several workers on one
  study, the fleet's incumbent (the root study's "continuous" attribute, written by whichever worker
  decided last) is adopted, a re-opened epoch joined.
- State: every decision is appended to the root study's user attribute "decisions" (the last
  `max_decisions`), the current state is its attribute "continuous" (epoch, incumbent, baselines),
  logged through `on_decision`, and published as the `moespec.tuner.incumbent` gauge. SIGTERM takes
  the Ctrl-C path: the running challenge is told FAIL and the saved incumbent re-applied by the CLI.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import optuna
from optuna.trial import TrialState

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.loop.assemble import Assembled
from tuner.loop.fleet import keep
from tuner.loop.metrics import TunerMetrics
from tuner.loop.space import SearchSpace, policy_key
from tuner.loop.trial import Challenge
from tuner.loop.tuning import NoTraffic
from tuner.measurement.admin import ServerUnavailable


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


@dataclass
class ShiftDetector:
    """Decides from challenge windows whether the workload changed under the incumbent.

    The plain-decoding baseline comes from the plain probes themselves (paired, same window), never
    from the search's values: the search's winner is the policy whose measurement was luckiest, so
    its value is biased low and a baseline built on it flags a shift that is only regression to the
    mean (the first benchmark run did exactly that). Probes that signal nothing are pooled into the
    baseline (geometric mean); a shift needs `confirmations` signalling probes in a row, or one in
    which plain decoding beats the incumbent with confidence."""

    config: ContinuousConfig
    plain_ratio: float | None = None  # cost(plain) / cost(incumbent), pooled over this incumbent's probes
    acceptance: float | None = None  # the incumbent's acceptance rate when it was chosen
    plain_probes: int = 0
    _plain_strikes: int = 0
    _acceptance_strikes: int = 0

    def observe_plain_probe(self, ratio: float, low: float, high: float) -> str | None:
        """`ratio` = cost(plain) / cost(incumbent) from a paired window, with its interval."""
        if not math.isfinite(ratio) or ratio <= 0:
            return None
        if self.plain_ratio is None:
            self.plain_ratio, self.plain_probes = ratio, 1
            return None
        moved = abs(math.log(ratio / self.plain_ratio)) > math.log1p(self.config.plain_shift)
        if moved and not low <= self.plain_ratio <= high:
            self._plain_strikes += 1
            # Plain decoding beating the incumbent with confidence needs no second look.
            if self._plain_strikes >= self.config.confirmations or high < 1.0:
                return (f"plain decoding now costs {ratio:.2f}x the incumbent (interval {low:.2f}-{high:.2f}), "
                        f"was {self.plain_ratio:.2f}x over {self.plain_probes} probes; {self._plain_strikes} "
                        f"probes in a row")
            return None
        self._plain_strikes = 0
        n = self.plain_probes
        self.plain_ratio = math.exp((n * math.log(self.plain_ratio) + math.log(ratio)) / (n + 1))
        self.plain_probes = n + 1
        return None

    def observe_acceptance(self, acceptance: float, drafted: int) -> str | None:
        if drafted < self.config.min_drafted_for_acceptance:
            return None
        if self.acceptance is None:
            self.acceptance = acceptance
            return None
        if abs(acceptance - self.acceptance) > self.config.acceptance_shift:
            self._acceptance_strikes += 1
        else:
            self._acceptance_strikes = 0
        if self._acceptance_strikes >= self.config.confirmations:
            return (f"the incumbent's acceptance rate moved from {self.acceptance:.2f} to {acceptance:.2f} "
                    f"in {self._acceptance_strikes} windows in a row")
        return None


@dataclass
class PromotionGate:
    """A challenger replaces the incumbent only after beating it with confidence in `confirmations`
    challenge rounds in a row (the continuous loop re-challenges a pending one at once). Why: a
    round's interval covers the requests' noise, not a machine whose speed moved between windows
    (interleaved rounds) or a lucky draw among near-equal policies, and on a steady workload the
    first version promoted back and forth between n-gram k=1, 2 and 3 (two promotions in one
    no-shift benchmark run, each "with confidence"). A round in which the pending challenger is not
    better clears it."""

    confirmations: int = 2
    pending: DraftPolicy | None = None
    wins: int = 0

    def observe(self, policy: DraftPolicy, better: bool) -> bool:
        """True when `policy` is to be promoted now."""
        same = self.pending is not None and policy_key(self.pending) == policy_key(policy)
        if not better:
            if same:
                self.pending, self.wins = None, 0
            return False
        self.wins = self.wins + 1 if same else 1
        self.pending = policy
        if self.wins >= self.confirmations:
            self.pending, self.wins = None, 0
            return True
        return False


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
        self.epoch = int(root.user_attrs.get("continuous", {}).get("epoch", 0))
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
                                                    prune=not probe)
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
        fleet's incumbent in the study (tuner/fleet.py)."""
        def reapplied(after: float) -> None:
            self._on_log(f"the server had lost the incumbent (restarted?): {self.incumbent.key.label()} "
                         f"({self.incumbent.policy.policy_id}) re-applied {after:.1f} s after it was last in place")

        keep(self._stop, seconds, self._config.policy_check_seconds,
             ensure=lambda: self.built.tuner.ensure(self.incumbent.policy), on_reapplied=reapplied,
             adopt=self._adopt_fleet_incumbent)

    def _adopt_fleet_incumbent(self) -> None:
        """Several workers on one study: whichever promoted last wrote the incumbent to the root
        study's "continuous" attribute; every worker runs that one (and joins a re-opened search)."""
        saved = self._root.user_attrs.get("continuous", {})
        theirs = saved.get("incumbent")
        if not theirs or self.incumbent is None:
            return
        epoch = int(saved.get("epoch", 0))
        if epoch > self.epoch:
            self._on_log(f"another worker re-opened the search (epoch {epoch}): joining it")
            self._open_epoch(epoch, resumed=True)
            return
        if epoch < self.epoch or theirs["policy_id"] == self.incumbent.policy.policy_id:
            return
        self.incumbent = self._score_from_saved(theirs)
        self.gate = PromotionGate(self._config.promote_confirmations)
        self.detector = ShiftDetector(self._config)
        self.detector.plain_ratio = saved.get("plain_ratio")
        self.detector.plain_probes = int(saved.get("plain_probes", 1 if saved.get("plain_ratio") else 0))
        self.detector.acceptance = saved.get("acceptance")
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
        saved = self._root.user_attrs.get("continuous", {})
        kept = saved.get("incumbent") if resumed and saved.get("epoch") == epoch else None
        self.detector = ShiftDetector(self._config)
        self.gate = PromotionGate(self._config.promote_confirmations)
        if kept is not None:
            self.incumbent = self._score_from_saved(kept)
            self.detector.plain_ratio = saved.get("plain_ratio")
            self.detector.plain_probes = int(saved.get("plain_probes", 1 if saved.get("plain_ratio") else 0))
            self.detector.acceptance = saved.get("acceptance")
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
        decisions = list(self._root.user_attrs.get("decisions", []))[-(self._config.max_decisions - 1):]
        decisions.append(d.as_dict())
        self._root.set_user_attr("decisions", decisions)
        self._root.set_user_attr("continuous", {
            "epoch": self.epoch,
            "incumbent": {"params": self.built.space.params_of(inc.policy), "policy_id": inc.policy.policy_id,
                          "value": inc.mean, "trial": inc.trials[0], "label": inc.key.label()},
            "plain_ratio": self.detector.plain_ratio,
            "plain_probes": self.detector.plain_probes,
            "acceptance": self.detector.acceptance,
        })
        if self._metrics is not None:
            self._metrics.decision(kind)
            self._metrics.incumbent(inc.policy.policy_id, inc.key.label(), inc.mean, self.epoch)
        self._on_decision(d)

    def _score_from_saved(self, saved: dict) -> st.PolicyScore:
        policy = self.built.space.policy_from_params(saved["params"], saved["policy_id"])
        value = float(saved["value"])
        return st.PolicyScore(policy_key(policy), policy, value, (value,), (int(saved["trial"]),))

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
