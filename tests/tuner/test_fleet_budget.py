"""The fleet's shared budget on a real PostgreSQL: search-trial slots claimed in the database, so
workers asking at the same moment never measure more search trials than the budget."""

from __future__ import annotations

import threading

import optuna
import pytest
from optuna.trial import TrialState

from tests.support.real_postgres import start_postgres
from tuner.loop import study as st
from tuner.loop.claims import PolicyClaims
from tuner.loop.fleet import Fleet


@pytest.fixture(scope="module")
def postgres():
    pg = start_postgres()
    yield pg
    pg.stop()


@pytest.fixture
def shared(postgres, request):
    url = postgres.create_database(request.node.name[:60].lower())
    storage = st.open_storage(url)
    study = optuna.create_study(storage=storage, study_name="budget")
    claims = PolicyClaims(url)
    yield study, storage, claims
    claims.close()


def ask_search(study: optuna.Study) -> optuna.Trial:
    trial = study.ask()
    trial.set_user_attr("role", st.ROLE_SEARCH)
    return trial


def test_a_slot_is_held_while_its_trial_runs_or_counts_and_freed_when_it_does_not(shared):
    study, storage, claims = shared
    w0, w1 = Fleet(claims, "w0"), Fleet(claims, "w1")
    a = ask_search(study)
    assert w0.take_budget_slot(study, storage, a.number, budget=1)
    b = ask_search(study)
    assert not w1.take_budget_slot(study, storage, b.number, budget=1)  # a is running
    a.set_user_attr("fail_reason", f"{st.FAIL_STARVED}: too little traffic")
    study.tell(a, state=TrialState.FAIL)  # measured nothing: does not count, its slot is free
    assert w1.take_budget_slot(study, storage, b.number, budget=1)
    study.tell(b, 0.004)
    c = ask_search(study)
    assert not w0.take_budget_slot(study, storage, c.number, budget=1)  # b counts: the budget is spent
    assert w0.take_budget_slot(study, storage, c.number, budget=2)


def test_workers_asking_together_take_no_more_slots_than_the_budget(shared):
    study, storage, claims = shared
    workers, budget = 6, 3
    start = threading.Barrier(workers)
    taken: list[bool] = []

    def one(i: int) -> None:
        trial = ask_search(study)
        fleet = Fleet(claims, f"w{i}")
        start.wait()
        taken.append(fleet.take_budget_slot(study, storage, trial.number, budget))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(taken) == [False] * (workers - budget) + [True] * budget
