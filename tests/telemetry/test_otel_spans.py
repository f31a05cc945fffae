"""Spans of real engine requests, received by a real OTLP/gRPC receiver, checked against the steps.

The engine's StepRecords are the ground truth: every exported attribute must equal what the records
say (aggregates recomputed here independently), arrays have one entry per MoE layer, and each
step's unique-expert count lies in [m, min(E, w*m)].
"""

from __future__ import annotations

import pytest

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.receiver import OtlpTraceReceiver
from otel.setup import build_telemetry_from_config
from service.types import (
    Controller,
    Drafter,
    DraftPolicy,
    GenerationRequest,
    InvalidRequest,
    PolicyCell,
    RequestKind,
    SamplingParams,
)

POLICIES = [
    DraftPolicy(Drafter.MODEL, 0, policy_id="plain"),
    DraftPolicy(Drafter.MODEL, 3, 0.7, policy_id="model-3"),
    DraftPolicy(Drafter.NGRAM, 4, policy_id="ngram-4"),
    DraftPolicy(Drafter.NGRAM, 8, policy_id="moespec-ngram-8", controller=Controller.MOESPEC),
]


@pytest.fixture(scope="module")
def receiver():
    with OtlpTraceReceiver() as rx:
        yield rx


def telemetry_for(receiver: OtlpTraceReceiver, info, **env):
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_BSP_SCHEDULE_DELAY": "20", "MOESPEC_VERIFY_SPAN_RATIO": "1", **env}
    return build_telemetry_from_config(TelemetryConfig.from_environ(environ), info, seed=1234)


def run(engine, telemetry, policy, prompt="def f(x):\n", max_new_tokens=24, temperature=0.0, seed=None):
    request = GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens,
                                sampling=SamplingParams(temperature=temperature, seed=seed))
    with telemetry.request(engine.info, request, policy) as obs:
        result = engine.generate(request, policy)
        obs.finish(result)
    return request, result, obs.trace_id


def trace_spans(receiver: OtlpTraceReceiver, trace_id: str, count: int) -> list[dict]:
    return [s for s in receiver.wait_for(lambda spans: sum(s["trace_id"] == trace_id for s in spans) >= count)
            if s["trace_id"] == trace_id]


def expected_request_attributes(engine, request, policy, result) -> dict:
    """Recomputed from the StepRecords alone (not from SpecStats)."""
    steps, L = result.steps, engine.info.num_layers
    return {
        a.GEN_AI_OPERATION_NAME: "text_completion",
        a.GEN_AI_PROVIDER_NAME: "moespec",
        a.GEN_AI_REQUEST_MODEL: engine.info.model_name,
        a.GEN_AI_REQUEST_TEMPERATURE: request.sampling.temperature,
        a.GEN_AI_REQUEST_MAX_TOKENS: request.max_new_tokens,
        a.GEN_AI_USAGE_INPUT_TOKENS: result.prompt_tokens,
        a.GEN_AI_USAGE_OUTPUT_TOKENS: len(result.token_ids),
        a.GEN_AI_RESPONSE_FINISH_REASONS: (result.finish_reason.value,),
        a.SPEC_POLICY_ID: policy.policy_id,
        a.SPEC_DRAFTER: policy.drafter.value,
        a.SPEC_DRAFT_LENGTH: policy.draft_length,
        a.SPEC_DRAFT_TEMPERATURE: policy.draft_temperature,
        a.SPEC_CONTROLLER: policy.controller.value,
        a.SPEC_VERIFY_STEPS: len(steps),
        a.SPEC_DRAFTED_TOKENS: sum(s.drafted for s in steps),
        a.SPEC_ACCEPTED_TOKENS: sum(s.accepted for s in steps),
        a.SPEC_COMMITTED_TOKENS: sum(s.committed for s in steps),
        a.SPEC_EMPTY_DRAFTS: sum(1 for s in steps if (s.draft_length if s.planned is None else s.planned)
                                 and not s.drafted),
        a.MOE_UNIQUE_EXPERTS_MEAN: tuple(sum(s.unique_experts[i] for s in steps) / len(steps) for i in range(L)),
        a.MOE_UNIQUE_EXPERTS_MAX: tuple(max(s.unique_experts[i] for s in steps) for i in range(L)),
        a.COST_DRAFT_SECONDS: sum(s.draft_seconds for s in steps),
        a.COST_VERIFY_SECONDS: sum(s.verify_seconds for s in steps),
        # the embedded engine verifies every step in a batch pass, alone or not
        a.MOE_BATCH_UNIQUE_EXPERTS_MEAN: tuple(sum(s.batch.unique_experts[i] for s in steps) / len(steps)
                                               for i in range(L)),
    }


def assert_attributes_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        if isinstance(value, float):
            assert actual[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        elif isinstance(value, tuple) and value and isinstance(value[0], float):
            assert actual[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert actual[key] == value, key


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.policy_id)
def test_request_and_verify_spans_match_the_engine_step_records(engine, receiver, policy):
    telemetry = telemetry_for(receiver, engine.info)
    try:
        request, result, trace_id = run(engine, telemetry, policy)
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    info = engine.info
    E, m, L = info.num_experts, info.top_k, info.num_layers

    (root,) = [s for s in spans if s["name"] == f"text_completion {info.model_name}"]
    assert root["kind"] == "INTERNAL" and root["status_code"] == "UNSET"
    assert root["resource"][a.RESOURCE_SERVICE_NAME] == "moespec"
    assert root["resource"][a.RESOURCE_MODEL_NAME] == info.model_name
    assert root["resource"][a.RESOURCE_BACKEND] == info.backend
    assert_attributes_equal(root["attributes"], expected_request_attributes(engine, request, policy, result))
    assert set(root["attributes"]) == set(a.REQUEST_SPAN_KEYS)
    assert len(root["attributes"][a.MOE_UNIQUE_EXPERTS_MEAN]) == L
    assert len(root["attributes"][a.MOE_UNIQUE_EXPERTS_MAX]) == L

    verify = sorted((s for s in spans if s["name"] == "verify"), key=lambda s: s["start_ns"])
    assert len(verify) == len(result.steps)  # ratio 1: every step
    for span, step in zip(verify, result.steps, strict=True):
        attrs = span["attributes"]
        assert set(attrs) == set(a.VERIFY_SPAN_KEYS)
        assert span["parent_span_id"] == root["span_id"]
        assert root["start_ns"] <= span["start_ns"] <= span["end_ns"] <= root["end_ns"]
        assert span["end_ns"] - span["start_ns"] == pytest.approx(step.verify_seconds * 1e9, abs=2)
        w = step.drafted + 1
        unique = attrs[a.MOE_UNIQUE_EXPERTS]
        assert len(unique) == L and unique == step.unique_experts
        assert attrs[a.MOE_PAIRWISE_OVERLAP_MIN] == step.pairwise_overlap_min
        assert attrs[a.MOE_PAIRWISE_OVERLAP_MEAN] == pytest.approx(step.pairwise_overlap_mean)
        assert all(0 <= low <= mean <= m for low, mean in zip(step.pairwise_overlap_min, step.pairwise_overlap_mean,
                                                              strict=True))
        assert all(m <= u <= min(E, w * m) for u in unique)
        assert attrs[a.MOE_UNIQUE_EXPERTS_BOUND] == min(E, w * m)
        assert attrs[a.MOE_WIDEST_LAYER] == max(range(L), key=unique.__getitem__)
        assert attrs[a.MOE_SHARED_EXPERTS] == info.shared_experts
        assert attrs[a.SPEC_ACCEPTED_TOKENS] == step.accepted <= step.drafted <= policy.draft_length
        assert attrs[a.SPEC_COMMITTED_TOKENS] == step.committed
        # EOS may cut the last step short; otherwise a step commits its accepted drafts + one token.
        if step is not result.steps[-1] or result.finish_reason.value == "length":
            assert attrs[a.SPEC_COMMITTED_TOKENS] == step.accepted + 1
        assert attrs[a.SPEC_DRAFTER] == policy.drafter.value
        assert attrs[a.SPEC_DRAFT_LENGTH] == policy.draft_length
        assert attrs[a.SPEC_DRAFTED_TOKENS] == step.drafted
        assert attrs[a.SPEC_CONTROLLER] == policy.controller.value
        assert attrs[a.COST_VERIFY_SECONDS] == step.verify_seconds
        assert attrs[a.COST_DECODE_STEP_EQUIVALENTS] == pytest.approx(step.decode_step_equivalents)
    # Every output token comes from a verify step.
    assert sum(s["attributes"][a.SPEC_COMMITTED_TOKENS] for s in verify) == result.completion_tokens
    assert root["attributes"][a.SPEC_COMMITTED_TOKENS] == root["attributes"][a.GEN_AI_USAGE_OUTPUT_TOKENS]


def test_trace_id_is_the_exported_trace_id(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info)
    try:
        _, result, trace_id = run(engine, telemetry, POLICIES[1], max_new_tokens=6)
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    assert len(trace_id) == 32 and int(trace_id, 16)
    assert {s["trace_id"] for s in spans} == {trace_id}


def test_sampled_request_with_sampling_temperature_and_seed(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info)
    policy = DraftPolicy(Drafter.MODEL, 2, 1.0, policy_id="sampled")
    try:
        request, result, trace_id = run(engine, telemetry, policy, temperature=0.8, seed=7, max_new_tokens=16)
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    (root,) = [s for s in spans if s["name"].startswith("text_completion")]
    assert_attributes_equal(root["attributes"], expected_request_attributes(engine, request, policy, result))


def test_verify_span_ratio_zero_keeps_the_exact_aggregates(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info, MOESPEC_VERIFY_SPAN_RATIO="0")
    try:
        request, result, trace_id = run(engine, telemetry, POLICIES[1], max_new_tokens=12)
        telemetry.force_flush()
        spans = trace_spans(receiver, trace_id, 1)
    finally:
        telemetry.shutdown()
    assert [s["name"] for s in spans] == [f"text_completion {engine.info.model_name}"]
    assert_attributes_equal(spans[0]["attributes"], expected_request_attributes(engine, request, POLICIES[1], result))


def test_verify_span_ratio_samples_a_share_of_the_steps(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info, MOESPEC_VERIFY_SPAN_RATIO="0.5")
    try:
        _, result, trace_id = run(engine, telemetry, POLICIES[0], max_new_tokens=40)
        telemetry.force_flush()
        spans = trace_spans(receiver, trace_id, 1)
    finally:
        telemetry.shutdown()
    verify = [s for s in spans if s["name"] == "verify"]
    assert 0 < len(verify) < len(result.steps)  # 39 steps at 0.5 (fixed seed)


def test_unsampled_trace_reports_no_trace_id_and_exports_nothing(engine):
    # A receiver of its own, so "nothing" means nothing: the unsampled requests are flushed first,
    # then a sampled request through the same kind of pipeline proves spans do arrive there.
    with OtlpTraceReceiver() as own:
        telemetry = telemetry_for(own, engine.info, OTEL_TRACES_SAMPLER="always_off")
        try:
            ids = [run(engine, telemetry, policy, max_new_tokens=6)[2] for policy in POLICIES]
            assert telemetry.force_flush()
        finally:
            telemetry.shutdown()
        marker = telemetry_for(own, engine.info)
        try:
            _, _, marker_id = run(engine, marker, POLICIES[0], max_new_tokens=4)
            arrived = trace_spans(own, marker_id, 1)
        finally:
            marker.shutdown()
        assert marker_id and arrived
        # Nothing from the unsampled requests: every span is the marker's, or one of its passes'
        # verify_batch spans (roots of their own traces, linked to the marker's request span).
        traces_served = {s["trace_id"] if s["name"] != a.VERIFY_BATCH_SPAN_NAME
                         else tuple(link["trace_id"] for link in s["links"]) for s in own.spans}
        assert traces_served == {marker_id, (marker_id,)}
        assert ids == [""] * len(POLICIES)


def test_server_fault_sets_error_status_and_error_type(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info)
    request = GenerationRequest(prompt="x", max_new_tokens=4)
    try:
        with telemetry.request(engine.info, request, POLICIES[0]) as obs:
            obs.fail(RuntimeError("backend crashed"), server_fault=True)
        (span,) = trace_spans(receiver, obs.trace_id, 1)
    finally:
        telemetry.shutdown()
    assert span["status_code"] == "ERROR" and "backend crashed" in span["status_message"]
    assert span["attributes"][a.ERROR_TYPE] == "RuntimeError"


def test_client_fault_keeps_status_unset(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info)
    request = GenerationRequest(prompt="x", max_new_tokens=4)
    try:
        with telemetry.request(engine.info, request, POLICIES[0]) as obs:
            obs.fail(InvalidRequest("max_new_tokens", "too many"), server_fault=False)
        (span,) = trace_spans(receiver, obs.trace_id, 1)
    finally:
        telemetry.shutdown()
    assert span["status_code"] == "UNSET"
    assert span["attributes"][a.ERROR_TYPE] == "InvalidRequest"


def test_an_exception_the_servicer_did_not_report_is_a_server_fault(engine, receiver):
    telemetry = telemetry_for(receiver, engine.info)
    request = GenerationRequest(prompt="x", max_new_tokens=4)
    try:
        with pytest.raises(KeyError), telemetry.request(engine.info, request, POLICIES[0]) as obs:
            raise KeyError("boom")
        (span,) = trace_spans(receiver, obs.trace_id, 1)
    finally:
        telemetry.shutdown()
    assert span["status_code"] == "ERROR" and span["attributes"][a.ERROR_TYPE] == "KeyError"


def test_a_telemetry_bug_never_fails_the_request(engine, receiver, caplog):
    import dataclasses

    telemetry = telemetry_for(receiver, engine.info)
    request = GenerationRequest(prompt="x = ", max_new_tokens=2, sampling=SamplingParams(temperature=0))
    result = engine.generate(request, POLICIES[0])
    broken = dataclasses.replace(result, steps=(dataclasses.replace(result.steps[0], unique_experts=None),))
    try:
        with telemetry.request(engine.info, request, POLICIES[0]) as obs:
            obs.finish(broken)  # must not raise
    finally:
        telemetry.shutdown()
    assert any("recording a finished request failed" in r.getMessage() for r in caplog.records)


def test_a_table_policy_steps_verify_spans_name_their_cell(engine, receiver):
    """A lone greedy request under a table runs the one-request greedy cell: its verify spans carry
    that cell's label and drafter; a policy without cells leaves the attribute out (above)."""
    table = DraftPolicy(Drafter.MODEL, 0, policy_id="table", cells=(
        PolicyCell(DraftPolicy(Drafter.NGRAM, 4), max_batch=1, kind=RequestKind.GREEDY),
        PolicyCell(DraftPolicy(Drafter.MODEL, 2), max_batch=1, kind=RequestKind.SAMPLED)))
    telemetry = telemetry_for(receiver, engine.info)
    try:
        _, result, trace_id = run(engine, telemetry, table, prompt="a b c a b c a b c a b c")
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    verify = [s["attributes"] for s in spans if s["name"] == "verify"]
    assert len(verify) == len(result.steps) and all(set(v) == {*a.VERIFY_SPAN_KEYS, a.SPEC_CELL} for v in verify)
    cells = {(v[a.SPEC_CELL], v[a.SPEC_DRAFTER], v[a.SPEC_DRAFT_LENGTH]) for v in verify}
    assert cells == {("b1-1.greedy", "ngram", 4)}
    assert sum(v[a.SPEC_DRAFTED_TOKENS] for v in verify) == result.spec.drafted_tokens > 0
