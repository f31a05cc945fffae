"""The tuner's Optuna study: storage URLs, resume after a crash, incumbent and winner selection.

Contract:
- `open_storage(url)`: `sqlite:///file.db`, `postgresql://...`, `mysql://...` (RDB), or
  `journal:PATH` (journal file, safe for several processes on one host), or `redis://...`
  (journal on Redis). Any failure raises `StorageError` with a one-line reason (password redacted).
  A SQLite or journal file is created 0600 and never through a symlink (it holds the study).
- `open_study` creates or loads (`load_if_exists`) a minimising study and refuses one that was
  created for the other objective (their values are not comparable).
- Trials carry user attributes `role` ("search" | "remeasure"), `tuner_id` and `heartbeat`;
  `recover_interrupted` fails RUNNING trials left by a dead tuner: its own (same tuner id: it was
  this tuner, killed) at once, other tuners' only once their heartbeat is stale.
- The incumbent is the policy with the lowest *mean* over its COMPLETE trials, so a re-measurement
  pulls a lucky first measurement back towards the truth. Paired modes pick the final winner by a
  confirmation round of direct ratios against one control (`confirmed_winner`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from service.security.private_files import create_private
from service.security.redact import redact_in, redact_url
from service.types import DraftPolicy
from tuner.loop.space import PolicyKey, SearchSpace, policy_key

ROLE_SEARCH = "search"
ROLE_REMEASURE = "remeasure"
ROLE_CHALLENGE = "challenge"  # continuous mode: a challenger beside the incumbent at the exploration share
FAIL_INTERRUPTED = "interrupted"
FAIL_STARVED = "starved"  # prefix of a starved window's fail_reason
FAIL_BUSY = "busy"  # prefix: another worker of the fleet was measuring that policy (tuner/fleet.py)
FAIL_UNREACHABLE = "server unreachable"  # prefix: the trial's server went away before it was measured
# prefix: a challenge stopped because the fleet's incumbent (its control) changed under it
FAIL_SUPERSEDED = "superseded"
# Trials failed for these reasons measured nothing and are redone: they never count towards --trials.
NOT_MEASURED = (FAIL_STARVED, FAIL_BUSY, FAIL_UNREACHABLE, FAIL_SUPERSEDED)


class StorageError(Exception):
    """The storage URL is malformed, its driver is missing, or it cannot be reached."""


class StudyMismatch(Exception):
    """An existing study was created for a different objective."""


def open_storage(url: str) -> optuna.storages.BaseStorage:
    try:
        if url.startswith("journal:"):
            path = url.removeprefix("journal:").removeprefix("//")
            if not path:
                raise StorageError("journal storage needs a file path, e.g. journal:./tuner.log")
            create_private(Path(path))
            return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
        if url.startswith("redis://"):
            return optuna.storages.JournalStorage(optuna.storages.journal.JournalRedisBackend(url))
        if "://" not in url:
            raise StorageError(f"{redact_url(url)!r} is not a storage URL (try sqlite:///tuner.db or "
                               "journal:tuner.log)")
        sqlite_file = sqlite_path(url)
        if sqlite_file is not None:
            create_private(sqlite_file)  # 0600, not through a symlink; SQLite's journals copy its mode
        return open_rdb_storage(url)
    except StorageError:
        raise
    except Exception as e:  # sqlalchemy, driver and OS errors all mean "cannot use this storage"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # Neither the URL nor a driver's echo of it may carry the password into a log.
        raise StorageError(redact_in(f"cannot open storage {url!r}: {type(e).__name__}: {first_line}", url)) from None


SCHEMA_RACE_ATTEMPTS = 5


def open_rdb_storage(url: str, attempts: int = SCHEMA_RACE_ATTEMPTS) -> optuna.storages.RDBStorage:
    """RDBStorage(url), surviving peers that create the schema at the same moment.

    Optuna creates its tables and version row on the first open. Fleet workers started together on a
    fresh database race there: PostgreSQL answers the loser with a unique violation on its catalog
    (or on the version row), although the schema the winner made is exactly the one wanted. An
    integrity error on open therefore means "a peer is creating it": the open is retried, and the
    retry finds the tables (create_all checks first). Any other error, or the race outlasting the
    attempts, goes up as before.
    """
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(attempts - 1):
        try:
            return optuna.storages.RDBStorage(url)
        except (IntegrityError, ProgrammingError) as e:
            # ProgrammingError: "relation ... already exists" (DuplicateTable), the same race
            # seen from CREATE TABLE rather than from the catalog's unique index.
            if isinstance(e, ProgrammingError) and "already exists" not in str(e):
                raise
            time.sleep(0.05 * (attempt + 1))
    return optuna.storages.RDBStorage(url)


def sqlite_path(url: str) -> Path | None:
    """The database file of a sqlite:/// URL (None for other URLs and in-memory databases)."""
    if not url.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def open_study(
    storage: optuna.storages.BaseStorage, name: str, sampler: optuna.samplers.BaseSampler, objective: str
) -> optuna.Study:
    try:
        study = optuna.create_study(
            storage=storage, study_name=name, sampler=sampler, direction="minimize", load_if_exists=True
        )
    except Exception as e:
        raise StorageError(f"cannot create or load study {name!r}: {type(e).__name__}: {e}") from e
    stored = study.user_attrs.get("objective")
    if stored is None:
        study.set_user_attr("objective", objective)
    elif stored != objective:
        raise StudyMismatch(
            f"study {name!r} was created for --objective {stored}, not {objective}; use another --study"
        )
    return study


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> int:
    """Storage id of a trial, through the public storage API (for attributes of finished-to-be trials)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    return storage.get_trial_id_from_study_id_trial_number(study_id, number)


def recover_interrupted(
    storage: optuna.storages.BaseStorage, study: optuna.Study, tuner_id: str, grace_seconds: float, now: float
) -> list[int]:
    """Tell FAIL for RUNNING trials a dead tuner left behind; returns their numbers."""
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get("tuner_id")
        # A trial just asked for has no owner or heartbeat yet (its worker sets them next): its start
        # is its last sign of life, or a fleet worker would fail another's trial in that gap.
        started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        heartbeat = float(trial.user_attrs.get("heartbeat", started))
        if owner != tuner_id and now - heartbeat < grace_seconds:
            continue  # another tuner's live trial
        tid = trial_id(storage, study, trial.number)
        storage.set_trial_user_attr(tid, "fail_reason", FAIL_INTERRUPTED)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        failed.append(trial.number)
    return failed


def beat(trial: optuna.Trial, clock=time.time) -> None:
    trial.set_user_attr("heartbeat", clock())


def role(trial: FrozenTrial) -> str:
    return str(trial.user_attrs.get("role", ROLE_SEARCH))


def search_trials_done(study: optuna.Study) -> int:
    """Finished search trials that count towards --trials: measured ones. Interrupted, starved, busy
    (another worker had the policy) and server-unreachable trials are redone (they measured nothing;
    `max_consecutive_failures` starved ones in a row stop the search instead, so no traffic cannot
    loop forever); re-proposals of a measured policy reuse its result and spend no traffic, so they
    do not count either (the budget is traffic spent, not sampler calls)."""
    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=finished) if counts_towards_budget(t))


def counts_towards_budget(t: FrozenTrial) -> bool:
    """A finished trial that `search_trials_done` counts."""
    if t.state not in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
        return False
    reason = str(t.user_attrs.get("fail_reason", ""))
    return (role(t) == ROLE_SEARCH and reason != FAIL_INTERRUPTED and not reason.startswith(NOT_MEASURED)
            and "duplicate_of" not in t.user_attrs)


@dataclass(frozen=True)
class PolicyScore:
    key: PolicyKey
    policy: DraftPolicy  # policy_id = <study>/<first trial number>
    mean: float
    values: tuple[float, ...]
    trials: tuple[int, ...]


def policy_id(study_name: str, number: int) -> str:
    return f"{study_name}/{number}"


def scores(
    study: optuna.Study, space: SearchSpace, roles: tuple[str, ...] = (ROLE_SEARCH, ROLE_REMEASURE)
) -> list[PolicyScore]:
    """COMPLETE trials grouped by policy, best mean first."""
    groups: dict[PolicyKey, list[FrozenTrial]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if role(t) not in roles or t.value is None or not math.isfinite(t.value) or "duplicate_of" in t.user_attrs:
            continue
        policy = space.policy_from_params(t.params, policy_id(study.study_name, t.number))
        groups.setdefault(policy_key(policy), []).append(t)
    out = []
    for key, trials in groups.items():
        trials.sort(key=lambda t: t.number)
        values = tuple(float(t.value) for t in trials)
        first = trials[0]
        out.append(
            PolicyScore(
                key=key,
                policy=space.policy_from_params(first.params, policy_id(study.study_name, first.number)),
                mean=sum(values) / len(values),
                values=values,
                trials=tuple(t.number for t in trials),
            )
        )
    out.sort(key=lambda s: s.mean)
    return out


def previous_result(study: optuna.Study, space: SearchSpace, key: PolicyKey) -> FrozenTrial | None:
    """The latest measured (COMPLETE or PRUNED, not itself a copy) trial of the same policy."""
    for t in reversed(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))):
        if "duplicate_of" not in t.user_attrs and policy_key(space.policy_from_params(t.params, "")) == key:
            return t
    return None


def incumbent(study: optuna.Study, space: SearchSpace) -> PolicyScore | None:
    ranked = scores(study, space)
    return ranked[0] if ranked else None


def remeasure_candidates(study: optuna.Study, space: SearchSpace, top: int) -> list[PolicyScore]:
    """The best `top` policies by their search measurements (stable across restarts)."""
    return scores(study, space, roles=(ROLE_SEARCH,))[:top]


def remeasured(study: optuna.Study, space: SearchSpace) -> dict[PolicyKey, int]:
    """How many remeasure trials each policy has finished or lost (attempts, not successes)."""
    counts: dict[PolicyKey, int] = {}
    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    for t in study.get_trials(deepcopy=False, states=finished):
        if role(t) == ROLE_REMEASURE:
            key = policy_key(space.policy_from_params(t.params, ""))
            counts[key] = counts.get(key, 0) + 1
    return counts


def winner(study: optuna.Study, space: SearchSpace, top: int) -> PolicyScore | None:
    """Among the re-measured top policies, the lowest mean over all their measurements."""
    keys = {c.key for c in remeasure_candidates(study, space, top)}
    ranked = [s for s in scores(study, space) if s.key in keys]
    return ranked[0] if ranked else incumbent(study, space)


def confirmed_winner(study: optuna.Study, space: SearchSpace, top: int) -> tuple[PolicyScore | None, dict | None]:
    """Paired modes: the search's incumbent (best of the top `top` by search trials) unless a
    confirmation trial (role remeasure, paired with that incumbent as control) measured a policy
    cheaper than it: then the one with the lowest ratio. Returns it and {label: ratio} (the control
    at 1.0); without any confirmation ratio, `winner`'s rule and None."""
    candidates = remeasure_candidates(study, space, top)
    if not candidates:
        return winner(study, space, top), None
    anchor = candidates[0]
    ratios: dict[PolicyKey, list[float]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        ratio = t.user_attrs.get("paired_ratio")
        if (role(t) != ROLE_REMEASURE or ratio is None or not math.isfinite(ratio)
                or t.user_attrs.get("control_policy") != anchor.key.label()):
            continue
        ratios.setdefault(policy_key(space.policy_from_params(t.params, "")), []).append(float(ratio))
    if not ratios:
        return winner(study, space, top), None
    # Several confirmations of one policy (a restarted tuner): their geometric mean.
    pooled = {key: math.exp(sum(map(math.log, rs)) / len(rs)) for key, rs in ratios.items()}
    pooled[anchor.key] = 1.0
    best_key = min(pooled, key=pooled.get)
    best = next(s for s in scores(study, space) if s.key == best_key)
    return best, {key.label(): round(r, 4) for key, r in sorted(pooled.items(), key=lambda kv: kv[1])}


def dashboard_hint(storage_url: str) -> str:
    """The command that opens the study, with any password in the URL redacted (it gets printed)."""
    target = storage_url.removeprefix("journal:") if storage_url.startswith("journal:") else redact_url(storage_url)
    return f"pip install optuna-dashboard && optuna-dashboard {target}"
