"""Policy claims (tuner/claims.py) in a real PostgreSQL: of workers racing for one policy exactly one
wins, a dead holder's claim is taken over, `once` is true once across workers."""

from __future__ import annotations

import threading

import pytest

from tests.support.real_postgres import start_postgres
from tuner.loop.claims import PolicyClaims


@pytest.fixture(scope="module")
def postgres():
    pg = start_postgres()
    yield pg
    pg.stop()


def test_of_eight_workers_racing_for_one_policy_exactly_one_gets_it(postgres):
    url = postgres.create_database("claims_race")
    workers = [PolicyClaims(url) for _ in range(8)]
    barrier = threading.Barrier(len(workers))
    results: dict[int, str | None] = {}

    def race(i: int) -> None:
        barrier.wait()
        results[i] = workers[i].claim("s", "ngram k=3", 100 + i, f"w{i}", live=lambda trial: True)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [i for i, held_by in results.items() if held_by is None]
    assert len(results) == 8 and len(winners) == 1
    assert all(results[i] == f"w{winners[0]} trial {100 + winners[0]}" for i in results if i != winners[0])
    # another policy and another study are independent
    assert workers[1].claim("s", "ngram k=4", 200, "w1", live=lambda t: True) is None
    assert workers[2].claim("other", "ngram k=3", 201, "w2", live=lambda t: True) is None
    # released: the next worker gets it
    workers[winners[0]].release("s", "ngram k=3", 100 + winners[0])
    assert workers[3].claim("s", "ngram k=3", 300, "w3", live=lambda t: True) is None
    for w in workers:
        w.close()


def test_a_dead_holders_claim_is_taken_over_and_a_live_ones_is_not(postgres):
    url = postgres.create_database("claims_dead")
    a, b = PolicyClaims(url), PolicyClaims(url)
    assert a.claim("s", "plain", 5, "a", live=lambda t: True) is None
    assert b.claim("s", "plain", 6, "b", live=lambda t: t == 5) == "a trial 5"  # trial 5 still running
    assert b.claim("s", "plain", 6, "b", live=lambda t: False) is None  # trial 5 failed: a died
    a.release("s", "plain", 5)  # the dead worker's late release must not drop b's claim
    assert a.claim("s", "plain", 7, "a", live=lambda t: t == 6) == "b trial 6"
    assert a.once("s", "initial-design", "a") and not b.once("s", "initial-design", "b")
    a.close()
    b.close()
