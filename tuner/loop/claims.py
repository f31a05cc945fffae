"""Policy claims: several `moespec tune` workers on one study never measure the same policy at once.

Contract: `PolicyClaims(url)` keeps one row per (study, policy) being measured in a table of its own,
`moespec_policy_claims`, in the study's relational database, with that pair as its primary key: the
database itself lets exactly one INSERT win, so two workers that are asked the same policy at the same
moment cannot both get it (Optuna's storage has no compare-and-set; a check of the RUNNING trials
followed by a write would leave a window between the two).
- `claim(study, policy, trial, worker, live)` -> None when this worker now holds it, else the holder
  ("worker trial N"). A row whose trial is no longer running (`live(trial)` False: its worker died
  and its trial was failed, see study.recover_interrupted) is taken over, not obeyed.
- `release(study, policy, trial)` drops the row if that trial still holds it.
- `once(study, key)`: True exactly once per (study, key) over every worker (the initial design is
  enqueued by one worker only).
`NoClaims` is the same interface for storages without a relational database (journal file, Redis):
one worker per study there, so every claim succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

TABLE = "moespec_policy_claims"
ONCE = -1  # trial number of a `once` row: never released, never stale


class PolicyClaims:
    def __init__(self, url: str):
        self._engine = sa.create_engine(url, pool_pre_ping=True)
        meta = sa.MetaData()
        self._table = sa.Table(
            TABLE, meta,
            sa.Column("study", sa.String(512), primary_key=True),
            sa.Column("policy", sa.String(512), primary_key=True),
            sa.Column("trial", sa.Integer, nullable=False),
            sa.Column("worker", sa.String(512), nullable=False),
            sa.Column("claimed_at", sa.Float, nullable=False),
        )
        try:
            meta.create_all(self._engine, checkfirst=True)
        except sa.exc.DBAPIError:
            # Two workers starting at once both saw no table and both created it (PostgreSQL refuses
            # the second CREATE): the other one's table is there now, which is all we need.
            meta.create_all(self._engine, checkfirst=True)

    def claim(self, study: str, policy: str, trial: int, worker: str, live: Callable[[int], bool]) -> str | None:
        for _ in range(3):  # insert; on conflict take over a dead holder's row, then insert again
            if self._insert(study, policy, trial, worker):
                return None
            holder = self._holder(study, policy)
            if holder is None:
                continue  # released between the two statements
            held_by, held_trial = holder
            if held_trial == trial:
                return None  # already ours
            if live(held_trial):
                return f"{held_by} trial {held_trial}"
            self._delete(study, policy, held_trial)
        holder = self._holder(study, policy)
        return f"{holder[0]} trial {holder[1]}" if holder else "another worker"

    def release(self, study: str, policy: str, trial: int) -> None:
        self._delete(study, policy, trial)

    def once(self, study: str, key: str, worker: str) -> bool:
        return self._insert(study, f"once:{key}", ONCE, worker)

    def close(self) -> None:
        self._engine.dispose()

    def _insert(self, study: str, policy: str, trial: int, worker: str) -> bool:
        try:
            with self._engine.begin() as conn:
                conn.execute(self._table.insert().values(study=study, policy=policy, trial=trial, worker=worker,
                                                         claimed_at=time.time()))
            return True
        except sa.exc.IntegrityError:
            return False

    def _holder(self, study: str, policy: str) -> tuple[str, int] | None:
        t = self._table
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(t.c.worker, t.c.trial).where(t.c.study == study, t.c.policy == policy)).first()
        return (row[0], int(row[1])) if row else None

    def _delete(self, study: str, policy: str, trial: int) -> None:
        t = self._table
        with self._engine.begin() as conn:
            conn.execute(t.delete().where(t.c.study == study, t.c.policy == policy, t.c.trial == trial))


class NoClaims:
    """One worker per study (journal and Redis storages): every claim is granted."""

    def claim(self, study: str, policy: str, trial: int, worker: str, live: Callable[[int], bool]) -> str | None:
        return None

    def release(self, study: str, policy: str, trial: int) -> None:
        pass

    def once(self, study: str, key: str, worker: str) -> bool:
        return True

    def close(self) -> None:
        pass


def claims_for(url: str) -> PolicyClaims | NoClaims:
    """Claims in the study's own database where it is relational (sqlite:, postgresql:, mysql:)."""
    if url.startswith(("journal:", "redis://")) or "://" not in url:
        return NoClaims()
    return PolicyClaims(url)
