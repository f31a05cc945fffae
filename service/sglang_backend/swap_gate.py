"""Requests run concurrently on the engine that is up; a policy that needs another engine drains
them first, then swaps.

A request whose policy runs on the current engine enters at once (no lock held while it runs).
One whose policy needs other start-up arguments becomes the swapper: new arrivals wait, it waits
for the requests in flight to finish, swaps, and then everyone who waited runs on the new engine,
under the policy it was swapped for (they arrived after that policy was set). None is lost; a swap
that fails raises in the swapper and lets the waiters try again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from service.types import DraftPolicy


class SwapGate:
    def __init__(self, key_of: Callable[[DraftPolicy], Hashable], swap: Callable[[DraftPolicy], None]):
        self._key_of, self._swap = key_of, swap
        self._cond = threading.Condition()
        self._key: Hashable | None = None  # the running engine's; None before the first start
        self._pending: DraftPolicy | None = None  # the policy a swap under way is for
        self._running = 0

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def enter(self, policy: DraftPolicy) -> DraftPolicy:
        """Blocks until the request may run; returns the policy it runs under. Pair with leave()."""
        with self._cond:
            swapped_for = None
            while self._pending is not None:
                swapped_for = self._pending
                self._cond.wait()
            if (self._key_of(policy) != self._key and swapped_for is not None
                    and self._key_of(swapped_for) == self._key):
                policy = swapped_for  # it waited for this swap: it runs under the policy swapped to
            if self._key_of(policy) == self._key:
                self._running += 1
                return policy
            self._pending = policy
            self._cond.wait_for(lambda: self._running == 0)
        try:
            self._swap(policy)
        except BaseException:
            with self._cond:
                self._key, self._pending = None, None  # no engine is known to be up: the next request starts one
                self._cond.notify_all()
            raise
        with self._cond:
            self._key, self._pending = self._key_of(policy), None
            self._running += 1
            self._cond.notify_all()
        return policy

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()
