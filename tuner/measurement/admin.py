"""The tuner's view of the server: ModelInfo, and setting/checking the draft policy.

Contract: gRPC failures become two exceptions the tuner acts on: `ServerUnavailable` (cannot reach
the server within `retry_seconds`: exit with a clear error, or wait out a restart mid-trial) and
`AdminRejected` (missing or wrong admin token: retrying cannot help). A restarted server is noticed
two ways, and either calls `on_server_changed`: `ensure*` finds another policy there (a fresh server
comes up with its own default id, never ours), or a call answers after calls had found the server
unreachable (it may have come back under a new instance id, and the first call to reach it may be a
challenge's own SetTrafficSplit, which `ensure*` would then find in place).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import grpc

from service.policy.traffic import TrafficSplit
from service.types import DraftPolicy, ModelInfo


class ServerUnavailable(Exception):
    """The server did not answer within the retry budget."""


class AdminRejected(Exception):
    """PolicyAdmin refused the admin token (UNAUTHENTICATED / PERMISSION_DENIED)."""


class PolicyClient(Protocol):
    def model_info(self, timeout: float | None = None) -> ModelInfo: ...

    def get_policy(self, timeout: float | None = None) -> DraftPolicy: ...

    def set_policy(self, policy: DraftPolicy, timeout: float | None = None) -> DraftPolicy: ...

    def get_split(self, timeout: float | None = None) -> TrafficSplit: ...

    def set_split(self, split: TrafficSplit, timeout: float | None = None) -> TrafficSplit: ...


_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_AUTH = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class PolicyAdmin:
    def __init__(
        self,
        client: PolicyClient,
        address: str,
        retry_seconds: float = 10.0,
        call_timeout: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        on_server_changed: Callable[[], None] = lambda: None,
    ):
        self._client = client
        self._on_server_changed = on_server_changed  # the server restarted (or may have): follow it
        self._was_unreachable = False
        self._address = address
        self._retry_seconds = retry_seconds
        self._timeout = call_timeout  # one RPC; a hung server must not hang the tuner
        self._sleep = sleep
        self._clock = clock

    def _call(self, what: str, fn: Callable[[], object], retry_seconds: float | None = None):
        budget = self._retry_seconds if retry_seconds is None else retry_seconds
        deadline = self._clock() + budget
        delay = 0.1
        while True:
            try:
                answer = fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in _AUTH:
                    raise AdminRejected(f"{what}: the server at {self._address} refused the admin token "
                                        f"(pass --admin-token or set MOESPEC_ADMIN_TOKEN)") from e
                if code not in _RETRYABLE:
                    raise
                self._was_unreachable = True
                if self._clock() >= deadline:
                    raise ServerUnavailable(
                        f"{what}: no answer from {self._address} for {budget:.0f} s ({code.name})"
                    ) from e
                self._sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            if self._was_unreachable:
                self._was_unreachable = False  # first: the callback makes calls of its own
                self._on_server_changed()
            return answer

    @property
    def call_timeout(self) -> float:
        return self._timeout

    def model_info(self) -> ModelInfo:
        return self._call("GetModelInfo", lambda: self._client.model_info(timeout=self._timeout))

    def current(self, retry_seconds: float | None = None) -> DraftPolicy:
        return self._call("GetPolicy", lambda: self._client.get_policy(timeout=self._timeout), retry_seconds)

    def apply(self, policy: DraftPolicy) -> DraftPolicy:
        return self._call("SetPolicy", lambda: self._client.set_policy(policy, timeout=self._timeout))

    def ensure(self, policy: DraftPolicy) -> bool:
        """Re-apply `policy` if the server runs another one; True when it had to."""
        if self.current(retry_seconds=0).policy_id == policy.policy_id:
            return False
        self.apply(policy)
        self._on_server_changed()
        return True

    def apply_split(self, split: TrafficSplit) -> TrafficSplit:
        return self._call("SetTrafficSplit", lambda: self._client.set_split(split, timeout=self._timeout))

    def ensure_split(self, split: TrafficSplit) -> bool:
        """Re-apply `split` if the server runs another one (compared by arm ids); True when it had to."""
        running = self._call("GetTrafficSplit", lambda: self._client.get_split(timeout=self._timeout), 0)
        if [a.policy.policy_id for a in running.arms] == [a.policy.policy_id for a in split.arms]:
            return False
        self.apply_split(split)
        self._on_server_changed()
        return True
