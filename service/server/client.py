"""A small blocking client for a moespec server, for the CLI, the tuner, loadgen and benchmarks.

    client = MoespecClient("127.0.0.1:50051", admin_token=None, tls_ca=None)
    client.wait_ready(timeout=60)
    reply = client.generate(GenerationRequest(prompt="def f(", max_new_tokens=32))
    for chunk in client.stream(request): ...   # chunk.text; chunk.reply on the last one
    client.set_policy(DraftPolicy(Drafter.NGRAM, 4, policy_id="trial-7"))
    client.set_split(TrafficSplit((TrafficArm(plain, 0.9), TrafficArm(candidate, 0.1))))

Dataclasses in and out (service.types); RPC failures surface as grpc.RpcError. Thread-safe: one
channel may serve many threads. `tls_ca` is PEM bytes (or a path) of the CA that signed the
server's certificate; without it the channel is plaintext. `tls_server_name` is the name the certificate
must carry when the target's host is another (an IP address).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.policy.traffic import TrafficSplit
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import convert
from service.types import DraftPolicy, FinishReason, GenerationRequest, ModelInfo, SpecStats

# Generous client-side limit: the server enforces its own, which is what a caller hits.
_MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class Reply:
    """What a server returned for one generation (the unary response, or a stream's summary)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    trace_id: str
    spec: SpecStats
    seconds: float  # server-side wall time, prefill included
    time_to_first_token: float


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]
    reply: Reply | None  # set on the last chunk: the whole text and the summary


class MoespecClient:
    def __init__(self, target: str, admin_token: str | None = None, tls_ca: bytes | str | Path | None = None,
                 tls_server_name: str | None = None):
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)]
        if tls_server_name:  # the certificate is checked against this name instead of the target's host
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None:
            ca = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca), options)
        else:
            self.channel = grpc.insecure_channel(target, options)
        self.target = target
        self._admin = (("authorization", f"Bearer {admin_token}"),) if admin_token else None
        self._inference = pb_grpc.InferenceStub(self.channel)
        self._policy = pb_grpc.PolicyAdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> MoespecClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inference ------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Reply:
        return _reply(self._inference.Generate(convert.request_to_pb(request), timeout=timeout))

    def stream(self, request: GenerationRequest, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield chunks as the server commits tokens. Closing the iterator early cancels the RPC."""
        call = self._inference.GenerateStream(convert.request_to_pb(request), timeout=timeout)
        text, token_ids = [], []
        try:
            for msg in call:
                text.append(msg.text)
                token_ids.extend(msg.token_ids)
                reply = _reply(msg, "".join(text), tuple(token_ids)) if msg.finish_reason else None
                yield Chunk(msg.text, tuple(msg.token_ids), reply)
        finally:
            call.cancel()  # no-op once the stream has ended; stops the server's work otherwise

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return convert.info_from_pb(self._inference.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout))

    # -- policy ---------------------------------------------------------------------------------
    def get_policy(self, timeout: float | None = None) -> DraftPolicy:
        return convert.policy_from_pb(self._policy.GetPolicy(pb.GetPolicyRequest(), metadata=self._admin,
                                                             timeout=timeout))

    def set_policy(self, policy: DraftPolicy, timeout: float | None = None) -> DraftPolicy:
        """Returns the policy as the server stored it (policy_id derived when left empty)."""
        msg = pb.SetPolicyRequest(policy=convert.policy_to_pb(policy))
        return convert.policy_from_pb(self._policy.SetPolicy(msg, metadata=self._admin, timeout=timeout))

    def get_split(self, timeout: float | None = None) -> TrafficSplit:
        msg = self._policy.GetTrafficSplit(pb.GetTrafficSplitRequest(), metadata=self._admin, timeout=timeout)
        return convert.split_from_pb(msg)

    def set_split(self, split: TrafficSplit, timeout: float | None = None) -> TrafficSplit:
        """Returns the split as stored (policy ids derived, the seed filled in when left unset)."""
        msg = pb.SetTrafficSplitRequest(split=convert.split_to_pb(split))
        return convert.split_from_pb(self._policy.SetTrafficSplit(msg, metadata=self._admin, timeout=timeout))

    # -- health ---------------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """The serving status name, e.g. "SERVING" or "NOT_SERVING"."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.1) -> None:
        """Block until the server reports SERVING; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last: Exception | str = "no answer"
        while time.monotonic() < deadline:
            try:
                status = self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                if status == "SERVING":
                    return
                last = status
            except grpc.RpcError as e:
                last = e.code().name
            time.sleep(interval)
        raise TimeoutError(f"{self.target} not ready after {timeout:g}s (last: {last})")


def _reply(msg: pb.GenerateResponse | pb.GenerateChunk, text: str | None = None,
           token_ids: tuple[int, ...] | None = None) -> Reply:
    return Reply(
        text=msg.text if text is None else text,
        token_ids=tuple(msg.token_ids) if token_ids is None else token_ids,
        finish_reason=convert.finish_reason_from_pb(msg.finish_reason),
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        trace_id=msg.trace_id,
        spec=convert.spec_from_pb(msg.spec),
        seconds=msg.seconds,
        time_to_first_token=msg.time_to_first_token,
    )
