"""Shared helpers for the tuner tests: a ModelInfo, request-span dicts, and a fake policy server
with synthetic traffic (for the loop's logic, fast) beside the real-server helpers in the e2e tests."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import grpc

from otel import attributes as attr
from service.policy.traffic import ArmAssigner, TrafficSplit
from service.types import Drafter, DraftPolicy, ModelInfo


def sample_space(space, n: int, seed: int) -> list[tuple[dict, DraftPolicy]]:
    """n policies a random sampler draws from a tuner SearchSpace: (the trial's params, its policy)."""
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        policy = space.suggest(trial, "p")  # (asks the params it reads: read them after)
        out.append((dict(trial.params), policy))
        study.tell(trial, 1.0)
    return out


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
        concurrent_policies=True,
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
    """PolicyClient in memory: records every SetPolicy / SetTrafficSplit, assigns arms per request
    with the server's own seeded assigner, can 'restart' (policy back to default) or go down."""

    def __init__(self, info: ModelInfo | None = None):
        self.info = info or model_info()
        self.lock = threading.Lock()
        self.assigner = ArmAssigner(TrafficSplit.single(DraftPolicy(policy_id="default"), seed=0))
        self.history: list[DraftPolicy] = []
        self.splits: list[TrafficSplit] = []
        self.down = False

    @property
    def policy(self) -> DraftPolicy:
        return self.assigner.split.primary

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
            self.assigner = ArmAssigner(TrafficSplit.single(policy, seed=len(self.history)))
            self.history.append(policy)
            return policy

    def get_split(self, timeout=None) -> TrafficSplit:
        self._check()
        with self.lock:
            return self.assigner.split

    def set_split(self, split: TrafficSplit, timeout=None) -> TrafficSplit:
        self._check()
        if len(split.arms) > 1 and not self.info.concurrent_policies:
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)
        with self.lock:
            stored = split if split.seed is not None else TrafficSplit(split.arms, seed=len(self.splits))
            self.assigner = ArmAssigner(stored)
            self.splits.append(stored)
            if len(stored.arms) == 1:
                self.history.append(stored.primary)
            return stored

    def next_policy(self) -> DraftPolicy:
        with self.lock:
            return self.assigner.next_policy()

    def restart(self) -> None:
        with self.lock:
            self.assigner = ArmAssigner(TrafficSplit.single(DraftPolicy(policy_id="default"), seed=0))


class SyntheticTraffic:
    """A thread that 'serves' a request every `period` s under the arm the fake server assigns it and
    hands its span to `sink`; the cost per committed token is `cost(policy) x speed()` (`speed` is the
    machine: 2.0 = everything twice as slow) times a seeded per-request noise factor."""

    def __init__(
        self,
        server: FakeServer,
        sink: Callable[[list[dict]], None],
        cost: Callable[[DraftPolicy], float],
        period: float = 0.002,
        tokens_per_request: int = 16,
        speed: Callable[[], float] = lambda: 1.0,
        noise: float = 0.0,
        seed: int = 0,
    ):
        self.server, self.sink, self.cost = server, sink, cost
        self.period, self.tokens = period, tokens_per_request
        self.speed, self.noise, self.rng = speed, noise, random.Random(seed)
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
            policy = self.server.next_policy()
            steps = max(1, self.tokens // (1 + policy.draft_length // 2))
            jitter = max(0.05, 1.0 + self.noise * self.rng.gauss(0.0, 1.0))
            seconds = self.cost(policy) * self.speed() * jitter * self.tokens
            self.sink([request_span(policy.policy_id, steps=steps, committed=self.tokens,
                                    drafted=steps * policy.draft_length, accepted=self.tokens - steps,
                                    draft_seconds=seconds * 0.2, verify_seconds=seconds * 0.8)])
