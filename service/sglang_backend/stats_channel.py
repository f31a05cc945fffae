"""The server side of the plugin's channel (service/sglang_plugin/wire.py): a PULL socket on a
private ipc path, and a thread that files each pass's records under the request ids they carry.

A request registers its rid before it is submitted; records for rids nobody registered (warm-ups,
requests already collected) are dropped, so memory is bounded by the requests in flight. `collect`
waits until a request's expected number of steps has arrived: the scheduler pushes a pass's record
right after the pass, before the request's last tokens reach the tokenizer, so the wait is short.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from service.security.private_files import private_dir
from service.sglang_plugin import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestPass:
    """One request's part of one measured pass."""

    stats: wire.PassStats
    index: int  # the request's place in the pass (batch order)
    pass_number: int  # passes this server received before it: unique across engine swaps


class StatsChannel:
    def __init__(self, directory: Path | None = None):
        import zmq  # SGLang's own dependency, present wherever this backend runs

        self._zmq = zmq
        self._own_dir = directory is None
        self._dir = private_dir(Path(directory or tempfile.mkdtemp(prefix="moespec-tap-")))
        self.endpoint = f"ipc://{self._dir / 'tap.sock'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the scheduler's queue is the bound
        self._socket.bind(self.endpoint)
        self._cond = threading.Condition()
        self._by_rid: dict[str, list[RequestPass]] = {}
        self._hellos: list[wire.Hello] = []
        self._passes = 0
        self.malformed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="moespec-tap-receiver", daemon=True)
        self._thread.start()

    def config(self, capture_topk: bool) -> wire.TapConfig:
        return wire.TapConfig(endpoint=self.endpoint, capture_topk=capture_topk)

    def wait_hello(self, since: int, timeout: float) -> wire.Hello | None:
        """The first hello after `since` hellos had arrived (one per engine started), or None."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._hellos) > since, timeout)
            return self._hellos[since] if len(self._hellos) > since else None

    @property
    def hellos(self) -> int:
        with self._cond:
            return len(self._hellos)

    @property
    def passes_received(self) -> int:
        with self._cond:
            return self._passes

    def register(self, rid: str) -> None:
        with self._cond:
            self._by_rid[rid] = []

    def collect(self, rid: str, expected: int, timeout: float) -> list[RequestPass]:
        """The request's records in pass order once `expected` arrived (or the timeout passed), unregistered."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(lambda: len(self._by_rid.get(rid, ())) >= expected,
                                max(0.0, deadline - time.monotonic()))
            return self._by_rid.pop(rid, [])

    def discard(self, rid: str) -> None:
        with self._cond:
            self._by_rid.pop(rid, None)

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()
        if self._own_dir:
            for path in self._dir.iterdir():
                path.unlink(missing_ok=True)
            self._dir.rmdir()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._socket, self._zmq.POLLIN)
        while not self._closed:
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            try:
                message = wire.decode(frames)
            except wire.WireError as e:
                self.malformed += 1
                log.warning("sglang tap: %s", e)
                continue
            with self._cond:
                if isinstance(message, wire.Hello):
                    self._hellos.append(message)
                else:
                    self._passes += 1
                    for index, rid in enumerate(message.rids):
                        mine = self._by_rid.get(rid)
                        if mine is not None:
                            mine.append(RequestPass(message, index, self._passes))
                self._cond.notify_all()
