"""The benchmark rig: a span receiver, `moespec serve` (embedded model) exporting to it, an admin
client and a closed-loop load whose prompt set can be switched mid-run (the workload shift).

    with open_rig(RigSpec(prompts, ...)) as rig:
        rig.admin, rig.collector          # for assemble() / Measurer
        rig.switch_prompts(other)         # the load serves another prompt set from now on
        rig.output_tokens()               # cumulative over every load generator so far
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from service.server.client import MoespecClient
from tuner.drivers.loadgen import LoadGenerator, LoadSpec
from tuner.drivers.server_proc import start_server, telemetry_env
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample


@dataclass(frozen=True)
class RigSpec:
    prompts: list[str]
    concurrency: int = 2
    max_new_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0
    threads: int | None = None
    record_steps: Path | None = None  # the server's --record-steps file


class Rig:
    def __init__(self, spec: RigSpec, client: MoespecClient, admin: PolicyAdmin, collector: SpanCollector):
        self.spec = spec
        self.client = client
        self.admin = admin
        self.collector = collector
        self._loads: list[tuple[LoadGenerator, threading.Thread, threading.Event]] = []

    def switch_prompts(self, prompts: list[str], temperature: float | None = None) -> None:
        """The load serves `prompts` from now on (sampled at `temperature` where given, else the spec's)."""
        self.stop_load()
        s = self.spec
        t = s.temperature if temperature is None else temperature
        gen = LoadGenerator(self.client, prompts, LoadSpec(concurrency=s.concurrency, max_new_tokens=s.max_new_tokens,
                                                          temperature=t, seed=s.seed))
        stop = threading.Event()
        thread = threading.Thread(target=gen.run, args=(stop,), daemon=True, name="rig-load")
        thread.start()
        self._loads.append((gen, thread, stop))

    def stop_load(self) -> None:
        if self._loads and not self._loads[-1][2].is_set():
            _, thread, stop = self._loads[-1]
            stop.set()
            thread.join(60)

    def output_tokens(self) -> int:
        return sum(gen.summary().output_tokens for gen, _, _ in self._loads)


@contextmanager
def open_rig(spec: RigSpec) -> Iterator[Rig]:
    from otel.receiver import OtlpTraceReceiver  # grpc server machinery only when a rig is opened

    token = secrets.token_hex(16)
    collector = SpanCollector(request_sample)
    with ExitStack() as stack:
        receiver = OtlpTraceReceiver("127.0.0.1", 0, on_spans=collector.on_spans)
        receiver.start()
        stack.callback(receiver.stop, 0.5)
        server_args = ("--threads", str(spec.threads)) if spec.threads else ()
        if spec.record_steps is not None:
            server_args += ("--record-steps", str(spec.record_steps))
        server = stack.enter_context(start_server(telemetry_env(receiver.endpoint), token, server_args))
        client = stack.enter_context(MoespecClient(server.address, admin_token=token))
        client.wait_ready(timeout=60)
        rig = Rig(spec, client, PolicyAdmin(client, server.address), collector)
        stack.callback(rig.stop_load)
        rig.switch_prompts(spec.prompts)
        yield rig
