"""Expert-parallel attributes of real engine requests (`--ep-size`), received by a real OTLP
receiver: present on every verify span and the request span, equal to a brute-force recount from
the step's own routed ids, within 1 <= ranks <= min(P, unique experts); absent without an EP size.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel import attributes as a
from otel.config import TelemetryConfig
from otel.setup import build_telemetry_from_config
from service.routing.expert_parallel import EPSpec
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import make_engine
from tests.telemetry.test_otel_spans import receiver, run, telemetry_for, trace_spans  # noqa: F401 (fixture)
from tuner.measurement.spans import request_sample

EP_SIZE = 4


@pytest.fixture(scope="module")
def engine():
    return make_engine(capture_topk=True, ep=EPSpec(size=EP_SIZE))


def brute_force(topk_layer, num_experts: int, hidden_bytes: int) -> tuple[int, int, int]:
    """Contiguous blocks, every position on rank 0: rank of e = e // (E / P)."""
    block = num_experts // EP_SIZE
    per_rank: dict[int, set[int]] = {}
    off = 0
    for position in topk_layer:
        for expert in position:
            per_rank.setdefault(expert // block, set()).add(expert)
            off += expert // block != 0
    return len(per_rank), max(len(s) for s in per_rank.values()), off * hidden_bytes


@pytest.mark.parametrize("policy", [DraftPolicy(Drafter.MODEL, 4, 0.0, policy_id="model-4"),
                                    DraftPolicy(Drafter.NGRAM, 6, policy_id="ngram-6")], ids=lambda p: p.policy_id)
def test_ep_attributes_are_exported_and_equal_a_recount(engine, receiver, policy):  # noqa: F811
    telemetry = telemetry_for(receiver, engine.info)
    try:
        _, result, trace_id = run(engine, telemetry, policy, max_new_tokens=20)
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    E, L = engine.info.num_experts, engine.info.num_layers
    hidden_bytes = engine.target.cfg.hidden_size * 2
    verify = sorted((s for s in spans if s["name"] == "verify"), key=lambda s: s["start_ns"])
    assert len(verify) == len(result.steps)
    total = 0
    for span, step in zip(verify, result.steps, strict=True):
        attrs = span["attributes"]
        assert set(a.EP_VERIFY_SPAN_KEYS) <= set(attrs)
        ranks, most = attrs[a.MOE_EP_RANKS_TOUCHED], attrs[a.MOE_EP_MAX_RANK_EXPERTS]
        assert len(ranks) == len(most) == L
        layer_bytes = 0
        for layer in range(L):
            unique = step.unique_experts[layer]
            assert 1 <= ranks[layer] <= min(EP_SIZE, unique)
            assert 1 <= most[layer] <= unique
            expected = brute_force(step.topk_ids[layer], E, hidden_bytes)
            assert (ranks[layer], most[layer]) == expected[:2]
            layer_bytes += expected[2]
        assert attrs[a.MOE_EP_DISPATCH_BYTES] == layer_bytes
        total += layer_bytes
    (root,) = [s for s in spans if s["name"].startswith("text_completion")]
    agg = root["attributes"]
    assert agg[a.MOE_EP_DISPATCH_BYTES] == total
    assert agg[a.MOE_EP_RANKS_TOUCHED_MEAN] == pytest.approx(
        [sum(s.ep_ranks_touched[i] for s in result.steps) / len(result.steps) for i in range(L)])
    assert agg[a.MOE_EP_MAX_RANK_EXPERTS_MAX] == tuple(max(s.ep_max_rank_experts[i] for s in result.steps)
                                                         for i in range(L))
    assert request_sample(root).ep_dispatch_bytes == total  # what the tuner's modelled cost reads


def test_without_an_ep_size_no_ep_attribute_is_exported(receiver):  # noqa: F811
    engine = make_engine()
    telemetry = telemetry_for(receiver, engine.info)
    try:
        _, result, trace_id = run(engine, telemetry, DraftPolicy(Drafter.NGRAM, 3, policy_id="no-ep"),
                                  max_new_tokens=6)
        spans = trace_spans(receiver, trace_id, 1 + len(result.steps))
    finally:
        telemetry.shutdown()
    keys = {k for s in spans for k in s["attributes"]}
    assert not keys & {*a.EP_VERIFY_SPAN_KEYS, *a.EP_REQUEST_SPAN_KEYS}


def test_ep_metrics_count_every_step(engine):
    reader = InMemoryMetricReader()
    telemetry = build_telemetry_from_config(TelemetryConfig(), engine.info, extra_metric_readers=[reader])
    policy = DraftPolicy(Drafter.NGRAM, 4, policy_id="ep-metrics")
    request = GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=16, sampling=SamplingParams(temperature=0))
    try:
        with telemetry.request(engine.info, request, policy) as obs:
            result = engine.generate(request, policy)
            obs.finish(result)
        points = {m.name: m.data.data_points for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics}
    finally:
        telemetry.shutdown()
    (dispatched,) = points[a.EP_DISPATCH_BYTES.name]
    assert dispatched.value == sum(s.ep_dispatch_bytes for s in result.steps)
    ranks = {p.attributes[a.MOE_LAYER]: p for p in points[a.STEP_EP_RANKS_TOUCHED.name]}
    for layer, point in ranks.items():
        assert point.count == len(result.steps)
        assert point.sum == sum(s.ep_ranks_touched[layer] for s in result.steps)
        assert point.min >= 1 and point.max <= EP_SIZE
