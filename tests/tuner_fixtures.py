"""Shared helpers for the tuner tests: a ModelInfo, request-span dicts, and a fake policy server
with synthetic traffic (for the loop's logic, fast) beside the real-server helpers in the e2e tests."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from otel import attributes as attr
from service.types import Drafter, DraftPolicy, ModelInfo


def model_info(**overrides) -> ModelInfo:
    fields = dict(
        backend="torch",
        model_name="moe",
        draft_model_name="draft",
        num_layers=4,
        num_experts=64,
        top_k=8,
        shared_experts=1,
        vocab_size=4096,
        max_context=512,
        max_draft_length=8,
        drafters=(Drafter.MODEL, Drafter.NGRAM),
        tunable=("drafter", "draft_length", "draft_temperature"),
        expert_bytes=1000,
        decode_step_seconds=0.002,
    )
    fields.update(overrides)
    return ModelInfo(**fields)


def request_span(
    policy_id: str,
    steps: int = 10,
    committed: int = 20,
    drafted: int = 30,
    accepted: int = 10,
    unique: tuple[float, ...] = (20.0, 10.0, 10.0, 8.0),
    draft_seconds: float = 0.01,
    verify_seconds: float = 0.03,
    name: str = "text_completion moe",
) -> dict:
    return {
        "name": name,
        "attributes": {
            attr.SPEC_POLICY_ID: policy_id,
            attr.SPEC_VERIFY_STEPS: steps,
            attr.SPEC_DRAFTED_TOKENS: drafted,
            attr.SPEC_ACCEPTED_TOKENS: accepted,
            attr.SPEC_COMMITTED_TOKENS: committed,
            attr.MOE_UNIQUE_EXPERTS_MEAN: list(unique),
            attr.COST_DRAFT_SECONDS: draft_seconds,
            attr.COST_VERIFY_SECONDS: verify_seconds,
            attr.GEN_AI_USAGE_OUTPUT_TOKENS: committed,
        },
    }


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeServer:
    """PolicyClient in memory: records every SetPolicy, can 'restart' (policy back to default) or go down."""

    def __init__(self, info: ModelInfo | None = None):
        self.info = info or model_info()
        self.lock = threading.Lock()
        self.policy = DraftPolicy(policy_id="default")
        self.history: list[DraftPolicy] = []
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)

    def model_info(self, timeout=None) -> ModelInfo:
        self._check()
        return self.info

    def get_policy(self, timeout=None) -> DraftPolicy:
        self._check()
        with self.lock:
            return self.policy

    def set_policy(self, policy: DraftPolicy, timeout=None) -> DraftPolicy:
        self._check()
        with self.lock:
            self.policy = policy
            self.history.append(policy)
            return policy

    def restart(self) -> None:
        with self.lock:
            self.policy = DraftPolicy(policy_id="default")


class SyntheticTraffic:
    """A thread that 'serves' a request every `period` s under the fake server's current policy and
    hands its span to `sink`; the cost per committed token is `cost(policy)`."""

    def __init__(
        self,
        server: FakeServer,
        sink: Callable[[list[dict]], None],
        cost: Callable[[DraftPolicy], float],
        period: float = 0.002,
        tokens_per_request: int = 16,
    ):
        self.server, self.sink, self.cost = server, sink, cost
        self.period, self.tokens = period, tokens_per_request
        self.stop_event = threading.Event()
        self.paused = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SyntheticTraffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stop_event.wait(self.period):
            if self.paused.is_set() or self.server.down:
                continue
            with self.server.lock:
                policy = self.server.policy
            steps = max(1, self.tokens // (1 + policy.draft_length // 2))
            seconds = self.cost(policy) * self.tokens
            self.sink([request_span(policy.policy_id, steps=steps, committed=self.tokens,
                                    drafted=steps * policy.draft_length, accepted=self.tokens - steps,
                                    draft_seconds=seconds * 0.2, verify_seconds=seconds * 0.8)])
