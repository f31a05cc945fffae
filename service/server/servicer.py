"""The moespec.v1 servicers: protobuf in, dataclasses to the engine runner, protobuf out.

Contract:
- Every generation runs under the arm of the traffic split assigned when it starts (drawn once,
  reported in spec.policy_id and its spans; see service.policy.traffic) and inside `telemetry.request(...)`,
  opened in the RPC's own context, ended by exactly one of `finish(result)` (also for a partial,
  cancelled generation) or `fail(error, ...)`.
- Limits before work: a prompt longer than the context (ids) or than its tokenizer can ever fit in
  it (text bytes) is refused from its lengths alone, before conversion; conversion and validation
  then run in a worker thread, so the event loop (health, other RPCs) never waits on them.
- Errors map to status codes here and only here: InvalidRequest -> INVALID_ARGUMENT (message starts
  with the field; the field is also the trailing metadata "moespec-invalid-field"), Overloaded ->
  RESOURCE_EXHAUSTED, a deadline that stopped the engine -> DEADLINE_EXCEEDED, anything else from
  the backend -> INTERNAL (a server fault). A cancelled RPC stops its generation (see runner).
- While the server drains (`draining()` true: shutting down) new generations are refused with
  UNAVAILABLE before they are queued; those already admitted run on, and if the grace period stops
  them (runner.stop_running) they answer normally with finish_reason "cancelled".
- Every response reports the token budget it ran with (convert.Budget: max_new_tokens cut to the
  context's room after the prompt, and whether that cut it).
- PolicyAdmin wants `authorization: Bearer <token>`, compared in constant time. With no token
  configured GetPolicy is open (the policy is public in every response anyway) and SetPolicy is
  refused with PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import grpc

from otel.api import NoTelemetry, RequestObservation, Telemetry
from service.limits import PromptLimits
from service.policy.ids import derived_id
from service.policy.offers import check_offered
from service.policy.traffic import ArmAssigner, TrafficSplit
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import convert
from service.server.runner import EngineRunner, GenerationCancelled, Overloaded
from service.types import (
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    ModelInfo,
    StreamDelta,
)

log = logging.getLogger(__name__)

INVALID_FIELD_KEY = "moespec-invalid-field"
SHUTTING_DOWN = ("the server is shutting down and takes no new generations (health reads NOT_SERVING): "
                 "send the request to another replica")


class PolicyStore:
    """The traffic split in force and its seeded arm assignment. Read and replaced on the event loop
    only, so no lock is needed; `assign` is called once per request, in the order requests start."""

    def __init__(self, info: ModelInfo, initial: DraftPolicy, seed_source: Callable[[], int] | None = None):
        self._info = info
        self._seed_source = seed_source or (lambda: secrets.randbits(63))
        self._assigner = ArmAssigner(self._seeded(TrafficSplit.single(self.check(initial))))

    def current(self) -> DraftPolicy:
        """The first arm's policy (the only one unless a split is set)."""
        return self._assigner.split.primary

    def split(self) -> TrafficSplit:
        return self._assigner.split

    def assign(self) -> DraftPolicy:
        """The policy the request starting now runs under."""
        return self._assigner.next_policy()

    def set(self, policy: DraftPolicy) -> DraftPolicy:
        """One arm with all the traffic."""
        self._assigner = ArmAssigner(self._seeded(TrafficSplit.single(self.check(policy))))
        return self.current()

    def set_split(self, split: TrafficSplit) -> TrafficSplit:
        checked = split.validate(self.check, self._info.concurrent_policies)
        self._assigner = ArmAssigner(self._seeded(checked))
        return self._assigner.split

    def _seeded(self, split: TrafficSplit) -> TrafficSplit:
        return split if split.seed is not None else replace(split, seed=self._seed_source())

    def check(self, policy: DraftPolicy) -> DraftPolicy:
        """Validate against this backend's bounds and offers (service.policy.offers: tables, drafters,
        controllers, tree widths); an empty policy_id is derived from the policy's canonical form
        (service.policy.ids), so policies that run alike share one id."""
        policy.validate(self._info.max_draft_length)
        check_offered(policy, self._info)
        if not policy.policy_id:
            policy = replace(policy, policy_id=derived_id(policy))
        return policy


@dataclass(eq=False)  # identity equality and hashing, as exceptions need
class _Failure(Exception):
    """A status to answer with; raised inside the generation, turned into context.abort outside it."""

    code: grpc.StatusCode
    details: str
    field: str = ""

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        metadata = ((INVALID_FIELD_KEY, self.field),) if self.field else ()
        await context.abort(self.code, self.details, trailing_metadata=metadata)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, runner: EngineRunner, info: ModelInfo, policies: PolicyStore, telemetry: Telemetry | None,
                 live_info: Callable[[], ModelInfo] | None = None, draining: Callable[[], bool] = lambda: False,
                 limits: PromptLimits | None = None):
        self._runner = runner
        self._draining = draining
        self._info = info
        self._limits = limits or PromptLimits(info.max_context, None, info.vocab_size)
        # Some fields change while serving (SGLang's policy_switches / policy_switch_seconds,
        # decode_step_seconds), so GetModelInfo reads the backend's current info when given it.
        self._live_info = live_info or (lambda: info)
        self._policies = policies
        self._telemetry = telemetry or NoTelemetry()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            result, trace_id, budget = await self._generate(request, context, on_delta=None)
        except _Failure as f:
            await f.abort(context)
        return convert.response_to_pb(result, trace_id, budget)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        # An async generator (what server interceptors such as OpenTelemetry's expect). The engine
        # runs in a task of its own, cancelled when the RPC ends for any reason: a generator left
        # suspended at `yield` by a vanished client is only closed later, when it is collected.
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[StreamDelta | None] = asyncio.Queue()

        def on_delta(delta: StreamDelta) -> None:  # engine thread -> event loop, in order
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        task = asyncio.ensure_future(self._generate(request, context, on_delta=on_delta))
        # Runs after every on_delta already scheduled, since the result is delivered the same way.
        task.add_done_callback(lambda _: deltas.put_nowait(None))
        context.add_done_callback(lambda _: task.cancel())
        text, token_ids = "", ()
        try:
            while (delta := await deltas.get()) is not None:
                if delta.text or delta.token_ids:
                    text += delta.text
                    token_ids += delta.token_ids
                    yield pb.GenerateChunk(text=delta.text, token_ids=delta.token_ids)
            result, trace_id, budget = task.result()
        except _Failure as f:
            await f.abort(context)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Whatever the deltas did not carry (normally nothing) rides on the final chunk, so the
        # concatenated stream always equals the unary response.
        tail_text = result.text[len(text):] if result.text.startswith(text) else ""
        tail_ids = result.token_ids[len(token_ids):]
        yield convert.final_chunk_to_pb(result, trace_id, budget, tail_text, tail_ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return convert.info_to_pb(self._live_info())

    async def _generate(
        self,
        request_pb: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        on_delta: Callable[[StreamDelta], None] | None,
    ) -> tuple[GenerationResult, str, convert.Budget]:
        if self._draining():
            raise _Failure(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        try:
            # Lengths only, before the ids are copied or the text tokenized: a prompt that can never fit
            # costs nothing (it gets no request span: no work was done for it).
            self._limits.check(request_pb)
        except InvalidRequest as e:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        # Assigned before the first await: arms follow the order requests start in (service.policy.traffic).
        policy = self._policies.assign()
        # Copying and validating up to a context of ids runs in a worker thread, never on the event
        # loop that answers health checks and every other RPC.
        request = await asyncio.to_thread(convert.request_from_pb, request_pb)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        with self._observe(request, policy) as obs:
            try:
                # Checked here as well as in the engine so bad input never waits in the queue.
                await asyncio.to_thread(request.validate, self._info.vocab_size, self._info.max_context)
                result = await self._runner.run(request, policy, deadline=deadline, on_delta=on_delta)
            except GenerationCancelled as e:
                if e.result is not None:
                    obs.finish(e.result)
                else:
                    obs.fail(e, server_fault=False)
                raise
            except InvalidRequest as e:
                obs.fail(e, server_fault=False)
                raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
            except Overloaded as e:
                obs.fail(e, server_fault=False)
                raise _Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            except Exception as e:
                log.exception("generation failed")
                obs.fail(e, server_fault=True)
                raise _Failure(grpc.StatusCode.INTERNAL, f"generation failed: {type(e).__name__}") from None
            obs.finish(result)
            trace_id = obs.trace_id
        if result.finish_reason is FinishReason.CANCELLED and deadline is not None and time.monotonic() >= deadline:
            raise _Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation")
        return result, trace_id, convert.Budget.of(request, result.prompt_tokens, self._info.max_context)

    def _observe(
        self, request: GenerationRequest, policy: DraftPolicy
    ) -> contextlib.AbstractContextManager[RequestObservation]:
        return self._telemetry.request(self._info, request, policy)


class PolicyAdminServicer(pb_grpc.PolicyAdminServicer):
    def __init__(self, policies: PolicyStore, admin_token: str | None):
        self._policies = policies
        self._token = admin_token.encode() if admin_token else None

    async def GetPolicy(self, request: pb.GetPolicyRequest, context: grpc.aio.ServicerContext) -> pb.DraftPolicy:
        if self._token is not None:
            await self._authenticate(context)
        return convert.policy_to_pb(self._policies.current())

    async def SetPolicy(self, request: pb.SetPolicyRequest, context: grpc.aio.ServicerContext) -> pb.DraftPolicy:
        await self._require_token(context)
        try:
            if not request.HasField("policy"):
                raise InvalidRequest("policy", "is missing")
            stored = self._policies.set(convert.policy_from_pb(request.policy))
        except InvalidRequest as e:
            await _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field).abort(context)
        log.info("draft policy set: %s", stored)
        return convert.policy_to_pb(stored)

    async def GetTrafficSplit(
        self, request: pb.GetTrafficSplitRequest, context: grpc.aio.ServicerContext
    ) -> pb.TrafficSplit:
        if self._token is not None:
            await self._authenticate(context)
        return convert.split_to_pb(self._policies.split())

    async def SetTrafficSplit(
        self, request: pb.SetTrafficSplitRequest, context: grpc.aio.ServicerContext
    ) -> pb.TrafficSplit:
        await self._require_token(context)
        try:
            if not request.HasField("split"):
                raise InvalidRequest("split", "is missing")
            stored = self._policies.set_split(convert.split_from_pb(request.split))
        except InvalidRequest as e:
            await _Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field).abort(context)
        log.info("traffic split set: %s", ", ".join(f"{a.policy.policy_id} x{a.weight:g}" for a in stored.arms))
        return convert.split_to_pb(stored)

    async def _require_token(self, context: grpc.aio.ServicerContext) -> None:
        if self._token is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "SetPolicy and SetTrafficSplit are disabled: the server has no admin token (start it with "
                "--admin-token or MOESPEC_ADMIN_TOKEN)",
            )
        await self._authenticate(context)

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        presented = _bearer_token(context.invocation_metadata() or ())
        if isinstance(presented, _NoBearer):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, presented.reason)
        # compare_digest on bytes: constant time in the token's content.
        if not hmac.compare_digest(presented.encode(), self._token):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "wrong admin token: send 'authorization: Bearer <token>'"
            )


@dataclass(frozen=True)
class _NoBearer:
    """Why the metadata holds no bearer token (the answer says which part is missing)."""

    reason: str


def _bearer_token(metadata) -> str | _NoBearer:
    headers = [value for key, value in metadata if key.lower() == "authorization" and isinstance(value, str)]
    if not headers:
        return _NoBearer("missing admin token: send 'authorization: Bearer <token>'")
    for value in headers:
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    scheme, _, token = headers[0].strip().partition(" ")
    if scheme.lower() == "bearer":
        return _NoBearer("missing admin token after the Bearer scheme: send 'authorization: Bearer <token>'")
    if not token:  # a bare value, such as the token itself
        return _NoBearer("the authorization header lacks the Bearer scheme: send 'authorization: Bearer <token>'")
    return _NoBearer(f"unsupported authorization scheme {scheme!r}: send 'authorization: Bearer <token>'")
