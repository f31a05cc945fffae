"""Spans of a request whose steps drafted trees, exported through the real pipeline to a real OTLP/gRPC
receiver: each tree step's verify span carries the tree's shape and its per-branch unions, the request
span the policy's width and the branch unions' mean, and a chain request's spans have none of them.

Most steps here are StepRecords as a backend that drafts trees reports them, written by hand so the
expected values are known; the last test runs the embedded engine's own trees."""

from __future__ import annotations

import pytest

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.receiver import OtlpTraceReceiver
from otel.setup import build_telemetry_from_config
from service.types import (
    Drafter,
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    StepRecord,
)
from tests.support.tuner_fixtures import model_info

INFO = model_info(num_layers=2, max_tree_width=2)
TREE = DraftPolicy(Drafter.MODEL, 6, 0.0, "model-k6-t0-tw2", tree_width=2)
CHAIN = DraftPolicy(Drafter.MODEL, 3, 0.0, "model-k3-t0")
PARENTS = (-1, -1, 0, 0, 2, 1)  # the first token's children 0 and 1; 0's children 2 and 3; 4 under 2; 5 under 1


def step(policy: DraftPolicy, path: tuple[int, ...], **tree) -> StepRecord:
    """A step that accepted the nodes `path` (a chain: the first len(path) drafts)."""
    drafted = len(tree.get("tree_parents", ())) or policy.draft_length
    return StepRecord.of_policy(policy, drafted=drafted, accepted=len(path), committed=len(path) + 1,
                                accepted_per_position=tuple(i in path for i in range(drafted)), window=drafted + 1,
                                unique_experts=(14, 12), shared_experts=1, num_experts=64, top_k=8,
                                draft_seconds=0.001, verify_seconds=0.004, decode_step_equivalents=2.0,
                                pairwise_overlap_mean=(3.0, 2.5), pairwise_overlap_min=(1, 0), **tree)


def result_of(policy: DraftPolicy, steps: list[StepRecord]) -> GenerationResult:
    committed = sum(s.committed for s in steps)
    return GenerationResult(text="", token_ids=tuple(range(committed)), finish_reason=FinishReason.LENGTH,
                            prompt_tokens=3, completion_tokens=committed,
                            spec=SpecStats.from_steps(steps, policy, INFO.num_layers), steps=tuple(steps),
                            seconds=0.05, time_to_first_token=0.01)


@pytest.fixture(scope="module")
def receiver():
    with OtlpTraceReceiver() as rx:
        yield rx


def exported(receiver: OtlpTraceReceiver, policy: DraftPolicy, steps: list[StepRecord]) -> tuple[dict, list[dict]]:
    """(request span attributes, verify span attributes in step order) of one request."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_BSP_SCHEDULE_DELAY": "20", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ(environ), INFO, seed=1)
    try:
        with telemetry.request(INFO, GenerationRequest(prompt="x", max_new_tokens=8), policy) as obs:
            obs.finish(result_of(policy, steps))
        spans = receiver.wait_for(lambda got: sum(s["trace_id"] == obs.trace_id for s in got) >= 1 + len(steps))
    finally:
        telemetry.shutdown()
    mine = [s for s in spans if s["trace_id"] == obs.trace_id]
    (root,) = [s for s in mine if s["name"].startswith("text_completion")]
    # in step order: steps lie back to back, ending with the request (they may all start at its start)
    verify = sorted((s for s in mine if s["name"] == a.VERIFY_SPAN_NAME), key=lambda s: (s["end_ns"], s["start_ns"]))
    return root["attributes"], [s["attributes"] for s in verify]


def test_tree_steps_carry_their_shape_and_branch_unions(receiver):
    steps = [step(TREE, (0, 2, 4), tree_parents=PARENTS, branch_unique=((10, 7), (9, 6), (8, 9))),
             step(TREE, (), tree_parents=(-1, -1), branch_unique=((9, 8), (9, 9)))]
    request, verify = exported(receiver, TREE, steps)
    first, second = verify
    assert set(first) == set(a.VERIFY_SPAN_KEYS) | set(a.TREE_VERIFY_SPAN_KEYS)
    assert (first[a.SPEC_TREE_WIDTH], first[a.SPEC_TREE_DEPTH], first[a.SPEC_TREE_BRANCHES]) == (2, 3, 3)
    assert first[a.MOE_BRANCH_UNIQUE_EXPERTS_MAX] == (10, 9)
    assert first[a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN] == pytest.approx((9.0, 22 / 3))
    assert first[a.MOE_UNIQUE_EXPERTS] == (14, 12)  # the union over every node of the tree
    assert (first[a.SPEC_DRAFTED_TOKENS], first[a.SPEC_ACCEPTED_TOKENS]) == (6, 3)
    assert (second[a.SPEC_TREE_DEPTH], second[a.SPEC_TREE_BRANCHES]) == (1, 2)
    assert second[a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN] == pytest.approx((9.0, 8.5))
    assert request[a.SPEC_TREE_WIDTH] == 2
    assert request[a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN] == pytest.approx(((9.0 + 9.0) / 2, (22 / 3 + 8.5) / 2))
    assert set(request) == (set(a.REQUEST_SPAN_KEYS) | set(a.TREE_POLICY_REQUEST_SPAN_KEYS)
                            | set(a.TREE_REQUEST_SPAN_KEYS)) - {a.MOE_BATCH_UNIQUE_EXPERTS_MEAN}


def test_a_chain_requests_spans_carry_no_tree_attributes(receiver):
    request, verify = exported(receiver, CHAIN, [step(CHAIN, (0, 1)), step(CHAIN, ())])
    tree_keys = set(a.TREE_VERIFY_SPAN_KEYS) | set(a.TREE_POLICY_REQUEST_SPAN_KEYS) | set(a.TREE_REQUEST_SPAN_KEYS)
    assert all(set(attrs) == set(a.VERIFY_SPAN_KEYS) for attrs in verify)
    assert tree_keys.isdisjoint(request)


def test_a_tree_policys_step_that_drafted_nothing_has_a_chain_span(receiver):
    """The last token of a budget is verified alone: a one-position window is no tree."""
    plain_step = StepRecord.of_policy(TREE, drafted=0, accepted=0, committed=1, accepted_per_position=(), window=1,
                                      unique_experts=(8, 8), shared_experts=1, num_experts=64, top_k=8,
                                      draft_seconds=0.0, verify_seconds=0.002, decode_step_equivalents=1.0)
    request, (verify,) = exported(receiver, TREE, [plain_step])
    assert set(verify) == set(a.VERIFY_SPAN_KEYS) - {a.MOE_PAIRWISE_OVERLAP_MEAN, a.MOE_PAIRWISE_OVERLAP_MIN}
    assert request[a.SPEC_TREE_WIDTH] == 2 and a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN not in request


def test_the_engines_tree_steps_are_reported_as_their_records_say(engine, receiver):
    policy = DraftPolicy(Drafter.MODEL, 6, 0.0, "engine-tw3", tree_width=3)
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_BSP_SCHEDULE_DELAY": "20", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    telemetry = build_telemetry_from_config(TelemetryConfig.from_environ(environ), engine.info, seed=1)
    request = GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=12)
    try:
        with telemetry.request(engine.info, request, policy) as obs:
            result = engine.generate(request, policy)
            obs.finish(result)
        spans = receiver.wait_for(lambda got: sum(s["trace_id"] == obs.trace_id for s in got) >= 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    mine = [s for s in spans if s["trace_id"] == obs.trace_id]
    verify = sorted((s for s in mine if s["name"] == a.VERIFY_SPAN_NAME), key=lambda s: (s["end_ns"], s["start_ns"]))
    trees = 0
    for span, step in zip(verify, result.steps, strict=True):
        attrs = span["attributes"]
        if not step.is_tree:
            assert set(a.TREE_VERIFY_SPAN_KEYS).isdisjoint(attrs)
            continue
        trees += 1
        assert len(step.tree_parents) == step.drafted and len(step.branch_unique) == attrs[a.SPEC_TREE_BRANCHES]
        assert (attrs[a.SPEC_TREE_WIDTH], attrs[a.SPEC_TREE_DEPTH]) == (3, step.tree_depth)
        assert attrs[a.MOE_BRANCH_UNIQUE_EXPERTS_MAX] == step.branch_unique_max
        assert attrs[a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN] == pytest.approx(step.branch_unique_mean)
        assert all(b <= u for b, u in zip(step.branch_unique_max, attrs[a.MOE_UNIQUE_EXPERTS], strict=True))
        assert sum(step.accepted_per_position) == attrs[a.SPEC_ACCEPTED_TOKENS] <= step.tree_depth
    assert trees > 0
    (root,) = [s for s in mine if s["name"].startswith("text_completion")]
    assert root["attributes"][a.SPEC_TREE_WIDTH] == 3
    assert root["attributes"][a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN] == pytest.approx(result.spec.branch_unique_experts_mean)
