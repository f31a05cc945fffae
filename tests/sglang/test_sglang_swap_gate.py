"""SwapGate: requests share the running engine; a swap drains them first, holds arrivals, and lets
them run on the new engine under the policy swapped to. Real threads, no sleeps for correctness."""

from __future__ import annotations

import threading

import pytest

from service.sglang_backend.swap_gate import SwapGate
from service.types import Drafter, DraftPolicy

PLAIN = DraftPolicy(draft_length=0, policy_id="plain")
K2 = DraftPolicy(Drafter.MODEL, draft_length=2, policy_id="k2")
K2_OTHER_ID = DraftPolicy(Drafter.MODEL, draft_length=2, policy_id="k2-again")


class Engines:
    """The swap callback: records each swap and what was running while it happened."""

    def __init__(self):
        self.swaps: list[int] = []
        self.running_during_swap: list[int] = []
        self.gate = SwapGate(lambda p: p.draft_length, self.swap)
        self.release = threading.Event()
        self.release.set()
        self.fail_next = False

    def swap(self, policy):
        self.running_during_swap.append(self.gate.running)
        self.release.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine start failed")
        self.swaps.append(policy.draft_length)


def test_requests_of_the_running_engine_enter_together_and_policy_ids_swap_nothing():
    engines = Engines()
    engines.gate.enter(K2)
    engines.gate.enter(K2_OTHER_ID)  # the same engine: enters while the first is still running
    assert engines.gate.running == 2 and engines.swaps == [2]
    engines.gate.leave()
    engines.gate.leave()


def test_a_swap_waits_for_the_requests_in_flight_and_arrivals_run_under_the_new_policy():
    engines = Engines()
    assert engines.gate.enter(PLAIN) == PLAIN  # the first start
    engines.release.clear()
    got: dict[str, DraftPolicy] = {}
    swapper = threading.Thread(target=lambda: got.setdefault("swapper", engines.gate.enter(K2)))
    swapper.start()
    # The swap cannot begin while the plain request runs.
    swapper.join(0.2)
    assert swapper.is_alive() and engines.swaps == [0]
    late = threading.Thread(target=lambda: got.setdefault("late", engines.gate.enter(PLAIN)))
    late.start()  # arrives during the drain with the old policy: it must wait, then run on the new engine
    late.join(0.2)
    assert late.is_alive()
    engines.gate.leave()  # the plain request finishes: now the swap runs
    engines.release.set()
    swapper.join(10)
    late.join(10)
    assert engines.swaps == [0, 2] and engines.running_during_swap == [0, 0]
    assert got == {"swapper": K2, "late": K2}
    assert engines.gate.running == 2


def test_a_failed_swap_raises_in_the_swapper_and_the_next_request_starts_an_engine():
    engines = Engines()
    engines.gate.enter(PLAIN)
    engines.gate.leave()
    engines.fail_next = True
    with pytest.raises(RuntimeError, match="engine start failed"):
        engines.gate.enter(K2)
    assert engines.gate.enter(K2) == K2 and engines.swaps == [0, 2]
    engines.gate.leave()
