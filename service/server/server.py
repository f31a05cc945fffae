"""Assembles and runs the gRPC server: servicers, health, reflection, limits, TLS, graceful stop.

Contract:
- `MoespecServer(backend, config, telemetry)`; `await start()` binds (port 0 picks a free port,
  see `.port`), marks health SERVING and returns; `await stop(grace)` drains, then stops:
  1. health turns NOT_SERVING for every name and new generations are refused with UNAVAILABLE,
     while the port stays open: health checks (a load balancer's probe must read NOT_SERVING, not
     a refused connection), GetModelInfo and PolicyAdmin keep answering;
  2. the generations in flight get up to `grace` seconds to finish (the drain ends as soon as none
     is left);
  3. those still running are stopped at their next engine step and answer normally with what they
     generated, finish_reason "cancelled" (a stream gets its final chunk): nothing is cancelled
     under a client, so no RPC ends with an error and nothing logs a traceback;
  4. the gRPC server stops (FINAL_RPC_SECONDS for those last answers and open health watches) and
     the engine workers are joined.
  The backend is not closed here: whoever created it closes it.
- `serve(...)` runs a server until SIGTERM / SIGINT, then stops it gracefully.
- Generation admission is the runner's (RESOURCE_EXHAUSTED when its queue is full); health,
  reflection, model info and PolicyAdmin are never queued behind generations.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from otel.api import Telemetry
from service.backend import Backend
from service.limits import PromptLimits, default_request_limit
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import reflection
from service.server.runner import EngineRunner
from service.server.servicer import InferenceServicer, PolicyAdminServicer, PolicyStore
from service.types import DraftPolicy, ModelInfo

log = logging.getLogger(__name__)

SERVICE_NAMES = tuple(pb.DESCRIPTOR.services_by_name[name].full_name for name in ("Inference", "PolicyAdmin"))
# The names health answers for: "" (the whole server) and each moespec service.
HEALTH_NAMES = ("", *SERVICE_NAMES)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# After the drain: how long the stopped generations' last answers (and open health watches) get
# before gRPC cancels what is left. A stopped generation answers within one engine step.
FINAL_RPC_SECONDS = 2.0
DRAIN_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port
    workers: int | None = None  # concurrent generate() callers; None: the backend's batch slots (`max_batch`)
    max_queue: int = 16  # generations waiting for a worker before RESOURCE_EXHAUSTED
    admin_token: str | None = None  # None: SetPolicy refused
    tls_cert: bytes | None = None  # PEM; with tls_key, serve TLS only
    tls_key: bytes | None = None
    max_message_bytes: int = 1 << 20  # largest response; larger requests are refused too
    # Largest request message (gRPC answers RESOURCE_EXHAUSTED beyond it); None: twice what a full
    # context needs (service.limits.default_request_limit), at most max_message_bytes.
    max_request_bytes: int | None = None
    grace_seconds: float = 10.0  # in-flight requests get this long after SIGTERM
    initial_policy: DraftPolicy = field(default_factory=DraftPolicy)
    instance_id: str = ""  # reported in GetModelInfo (and, by the caller, as service.instance.id); "" = none


class MoespecServer:
    def __init__(
        self,
        backend: Backend,
        config: ServerConfig = ServerConfig(),
        telemetry: Telemetry | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ):
        self.config = config
        self._backend = backend
        self.info = self._with_instance(backend.info)
        workers = config.workers or max(1, getattr(backend, "max_batch", 1))
        self.runner = EngineRunner(backend, workers=workers, max_queue=config.max_queue)
        self.policies = PolicyStore(self.info, config.initial_policy)
        # Checked before any work on a request; a backend without its own says only the context.
        self.limits: PromptLimits = getattr(backend, "prompt_limits", None) or PromptLimits(
            self.info.max_context, None, self.info.vocab_size)
        self.max_request_bytes = config.max_request_bytes or min(default_request_limit(self.limits),
                                                                 config.max_message_bytes)
        self._telemetry = telemetry
        self._interceptors = tuple(interceptors)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._draining = False
        self.port = 0

    def _with_instance(self, info: ModelInfo) -> ModelInfo:
        return replace(info, instance_id=self.config.instance_id) if self.config.instance_id else info

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # port 0 must really be free, not shared with another server
        ]
        server = grpc.aio.server(options=options, interceptors=self._interceptors)
        pb_grpc.add_InferenceServicer_to_server(
            InferenceServicer(self.runner, self.info, self.policies, self._telemetry,
                              live_info=lambda: self._with_instance(self._backend.info),
                              draining=lambda: self._draining, limits=self.limits), server
        )
        pb_grpc.add_PolicyAdminServicer_to_server(PolicyAdminServicer(self.policies, cfg.admin_token), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable(server, (*SERVICE_NAMES, HEALTH_SERVICE))
        target = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert and cfg.tls_key:
            creds = grpc.ssl_server_credentials([(cfg.tls_key, cfg.tls_cert)])
            self.port = server.add_secure_port(target, creds)
        else:
            self.port = server.add_insecure_port(target)
        await server.start()
        self._server = server
        for name in HEALTH_NAMES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        if self._server is None:
            return
        grace = self.config.grace_seconds if grace is None else grace
        self._draining = True
        await self._health.enter_graceful_shutdown()
        await self._drain(grace)
        await self._server.stop(FINAL_RPC_SECONDS)
        # Blocking join of the worker threads: off the loop, it can take one engine step.
        await asyncio.to_thread(self.runner.close)
        self._server = None

    async def _drain(self, grace: float) -> None:
        """Let the generations in flight finish for up to `grace` seconds, then stop the rest (they
        answer with finish_reason "cancelled") and wait until every one has answered."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, grace)
        while self.runner.in_flight and loop.time() < end:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if self.runner.in_flight:
            stopped = self.runner.stop_running()
            log.warning("shutdown grace period (%.3g s) over: stopping %d generation(s); they answer "
                        "finish_reason 'cancelled'", grace, stopped)
        end = loop.time() + FINAL_RPC_SECONDS
        while self.runner.in_flight and loop.time() < end:  # one engine step each
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(
    backend: Backend,
    config: ServerConfig,
    telemetry: Telemetry | None = None,
    on_ready: Callable[[MoespecServer], None] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    server = MoespecServer(backend, config, telemetry, interceptors)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if on_ready is not None:
        on_ready(server)
    try:
        await stopping.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
