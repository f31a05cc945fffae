"""The scheduler side of the channel (wire.py): a thread that waits for each pass's statistics to
reach the host and pushes them to moespec's server.

The scheduler's thread only enqueues (device tensors already copying to pinned host memory, and an
event); this thread waits on the event, so no forward pass waits for a device-to-host copy. Sends
never block: should the server stop reading, ZeroMQ's queue fills and later records are dropped
(telemetry never holds up inference).
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from service.sglang_plugin import wire

log = logging.getLogger(__name__)
SEND_QUEUE = 100_000  # messages ZeroMQ holds while the server is slow to read


class Sender:
    def __init__(self, endpoint: str):
        import zmq  # SGLang's own dependency; imported here so the wire format stays importable without it

        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(endpoint)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._dropped = 0
        threading.Thread(target=self._run, name="moespec-tap-sender", daemon=True).start()

    def hello(self, hello: wire.Hello) -> None:
        self._queue.put((wire.encode_hello(hello), None, None))

    def pass_stats(self, header: dict, tensors: dict[str, torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """header: PassStats fields but the arrays; tensors: host tensors (being copied while `ready` is pending)."""
        self._queue.put((header, tensors, ready))

    def _run(self) -> None:
        while True:
            header, tensors, ready = self._queue.get()
            try:
                if tensors is None:
                    frames = header
                else:
                    if ready is not None:
                        ready.synchronize()  # this thread waits, not the scheduler
                    arrays = {k: v.numpy() for k, v in tensors.items()}
                    frames = wire.encode_pass(wire.PassStats(**header, **arrays))
                self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                self._dropped += 1
                if self._dropped in (1, 100, 10_000):
                    log.warning("moespec tap: the server is not reading; %d records dropped", self._dropped)
            except Exception:  # never let telemetry take the scheduler down
                log.exception("moespec tap: a record could not be sent")
