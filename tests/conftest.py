"""Shared fixtures: one real Engine per session, real gRPC servers on 127.0.0.1 port 0.

Servers run on their own event loop in a background thread, so tests use ordinary blocking gRPC
clients over loopback. The engine is wrapped in `RecordingBackend`, a pass-through that keeps every
(request, result) pair so tests can observe what the engine really did (e.g. stopped early).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server.client import MoespecClient
from service.server.server import MoespecServer, ServerConfig
from service.types import DraftPolicy, GenerationRequest, GenerationResult, ModelInfo, StreamDelta

ADMIN_TOKEN = "test-admin-token"


class RecordingBackend:
    """The real engine, plus a log of what each call returned (not a mock: every call runs it)."""

    def __init__(self, engine):
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.max_batch: int = engine.max_batch  # so the server runs as many callers as the engine batches
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.calls: list[tuple[GenerationRequest, GenerationResult]] = []

    def generate(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> GenerationResult:
        result = self.engine.generate(request, policy, should_stop=should_stop, on_delta=on_delta)
        with self._done:
            self.calls.append((request, result))
            self._done.notify_all()
        return result

    def close(self) -> None:
        pass

    def result_for(self, seed: int, timeout: float = 30.0) -> GenerationResult:
        """The result of the (latest) call with this sampling seed; waits for it to finish."""
        deadline = time.monotonic() + timeout
        with self._done:
            while True:
                found = [r for q, r in self.calls if q.sampling.seed == seed]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the engine never finished a request with seed {seed}")
                self._done.wait(left)

    def ran(self, seed: int) -> bool:
        with self._lock:
            return any(q.sampling.seed == seed for q, _ in self.calls)


class ServerThread:
    """A MoespecServer on a private event loop in a daemon thread."""

    def __init__(self, backend, config: ServerConfig, telemetry=None, interceptors=()):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        self.server = MoespecServer(backend, config, telemetry, interceptors)
        self.call(self.server.start())

    @property
    def address(self) -> str:
        return self.server.address

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def engine():
    from service.engine import Engine, EngineConfig

    # One intra-op thread: the gRPC loop and the test's clients need the other core.
    e = Engine(EngineConfig(threads=1))
    yield e
    e.close()


@pytest.fixture(scope="session")
def backend(engine) -> RecordingBackend:
    return RecordingBackend(engine)


@pytest.fixture(scope="session")
def server(backend) -> Iterator[ServerThread]:
    s = ServerThread(backend, ServerConfig(port=0, admin_token=ADMIN_TOKEN, max_queue=32))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server) -> Iterator[MoespecClient]:
    with MoespecClient(server.address, admin_token=ADMIN_TOKEN) as c:
        c.wait_ready(timeout=30)
        yield c


@pytest.fixture(scope="session")
def stubs(server) -> Iterator[tuple[pb_grpc.InferenceStub, pb_grpc.PolicyAdminStub]]:
    """Raw stubs, for requests the dataclass client would never build."""
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.InferenceStub(channel), pb_grpc.PolicyAdminStub(channel)


@pytest.fixture
def default_policy(client) -> Iterator[None]:
    """Tests that change the shared server's policy put the default back afterwards."""
    yield
    client.set_policy(DraftPolicy(policy_id="default"))
