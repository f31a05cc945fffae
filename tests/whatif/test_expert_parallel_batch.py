"""The EP view of whole batch passes (continuous batching, `--ep-size`): concurrent real engine
requests share target passes; each pass's record equals a brute-force recount over every position
of every request it served (their own steps' routed ids), under an EPLB-style placement with
redundant experts, stays within 1 <= ranks <= min(P, batch union), and reaches a real OTLP receiver
on the `verify_batch` span and the batch EP histograms once per pass."""

from __future__ import annotations

import random

import pytest
import torch
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel import attributes as a
from otel.receiver import OtlpTraceReceiver
from service.routing.expert_parallel import EPSpec
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import make_engine
from tests.telemetry.test_otel_batch import receiver_telemetry, traced_requests
from tests.whatif.test_expert_parallel import brute_force

EP_SIZE = 4
EXTRA_PER_RANK = 4  # redundant slots per rank: EPLB-style replicas of experts another rank holds
REQUESTS = 6
POLICIES = [DraftPolicy(policy_id="plain"), DraftPolicy(Drafter.NGRAM, 4, policy_id="ngram-4"),
            DraftPolicy(Drafter.MODEL, 3, 0.0, policy_id="model-3")]


def redundant_placement(num_layers: int, num_experts: int, seed: int = 13) -> list[list[int]]:
    """Per layer: every expert once (shuffled over the ranks), plus replicas of experts held elsewhere."""
    rng = random.Random(seed)
    base = num_experts // EP_SIZE
    layers = []
    for _ in range(num_layers):
        experts = rng.sample(range(num_experts), num_experts)
        slots = []
        for r in range(EP_SIZE):
            own = experts[r * base:(r + 1) * base]
            slots += own + rng.sample([e for e in experts if e not in own], EXTRA_PER_RANK)
        layers.append(slots)
    return layers


@pytest.fixture(scope="module")
def ep_engine():
    probe = make_engine()
    L, E = probe.info.num_layers, probe.info.num_experts
    probe.close()
    p2l = redundant_placement(L, E)
    engine = make_engine(capture_topk=True, ep=EPSpec(size=EP_SIZE, physical_to_logical=torch.tensor(p2l)))
    yield engine, p2l
    engine.close()


@pytest.fixture(scope="module")
def exported(ep_engine):
    """Concurrent traced requests on the EP engine -> (results, verify_batch spans, metric points)."""
    engine, _ = ep_engine
    reader = InMemoryMetricReader()
    with OtlpTraceReceiver() as rx:
        telemetry = receiver_telemetry(rx, engine, reader, seed=3)
        try:
            results = [result for result, _ in traced_requests(engine, telemetry, REQUESTS, POLICIES)]
            passes = {s.batch.pass_id for r in results for s in r.steps}
            spans = rx.wait_for(lambda got: sum(s["name"] == a.VERIFY_BATCH_SPAN_NAME for s in got) >= len(passes))
        finally:
            metrics = reader.get_metrics_data()
            telemetry.shutdown()
    points = {m.name: list(m.data.data_points) for rm in metrics.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}
    return results, [s for s in spans if s["name"] == a.VERIFY_BATCH_SPAN_NAME], points


def steps_by_pass(results) -> dict:
    served: dict[int, list] = {}
    for result in results:
        for step in result.steps:
            served.setdefault(step.batch.pass_id, []).append(step)
    return served


def test_batch_pass_ep_view_equals_a_brute_force_recount_over_its_requests_ids(ep_engine, exported):
    engine, p2l = ep_engine
    results, _, _ = exported
    hidden_bytes = engine.target.cfg.hidden_size * 2
    served = steps_by_pass(results)
    assert max(len(steps) for steps in served.values()) >= 3, "the requests never shared a pass"
    for steps in served.values():
        record = steps[0].batch
        assert len(steps) == record.batch_size
        # The pass's positions: every request's window, each position with its own m routed ids.
        pass_ids = [[pos for s in steps for pos in s.topk_ids[layer]] for layer in range(engine.info.num_layers)]
        ranks, most, offrank = brute_force(p2l, EP_SIZE, pass_ids, [0] * record.positions)
        assert record.ep_ranks_touched == tuple(ranks)
        assert record.ep_max_rank_experts == tuple(most)
        assert record.ep_dispatch_bytes == sum(offrank) * hidden_bytes
        # Properties of the pass against its requests' own views.
        assert record.ep_dispatch_bytes == sum(s.ep_dispatch_bytes for s in steps)
        for layer, union in enumerate(record.unique_experts):
            assert 1 <= record.ep_ranks_touched[layer] <= min(EP_SIZE, union)
            assert 1 <= record.ep_max_rank_experts[layer] <= union
            assert record.ep_ranks_touched[layer] >= max(s.ep_ranks_touched[layer] for s in steps)
            assert record.ep_max_rank_experts[layer] >= max(s.ep_max_rank_experts[layer] for s in steps)


def test_verify_batch_spans_carry_the_pass_ep_view(exported):
    results, batch_spans, _ = exported
    records = {pass_id: steps[0].batch for pass_id, steps in steps_by_pass(results).items()}
    by_pass = {s["attributes"][a.BATCH_PASS_ID]: s["attributes"] for s in batch_spans}
    assert set(by_pass) == set(records)
    for pass_id, record in records.items():
        attrs = by_pass[pass_id]
        assert set(attrs) == {*a.VERIFY_BATCH_SPAN_KEYS, *a.EP_VERIFY_BATCH_SPAN_KEYS}
        assert attrs[a.MOE_BATCH_EP_RANKS_TOUCHED] == record.ep_ranks_touched
        assert attrs[a.MOE_BATCH_EP_MAX_RANK_EXPERTS] == record.ep_max_rank_experts
        assert attrs[a.MOE_BATCH_EP_DISPATCH_BYTES] == record.ep_dispatch_bytes


def test_batch_ep_histograms_count_every_pass_once(exported):
    results, _, points = exported
    records = [steps[0].batch for steps in steps_by_pass(results).values()]
    for spec, field in ((a.BATCH_EP_RANKS_TOUCHED, "ep_ranks_touched"),
                        (a.BATCH_EP_MAX_RANK_EXPERTS, "ep_max_rank_experts")):
        per_layer = {p.attributes[a.MOE_LAYER]: p for p in points[spec.name]}
        assert sorted(per_layer) == list(range(len(records[0].unique_experts)))
        for layer, point in per_layer.items():
            assert point.count == len(records)
            assert point.sum == sum(getattr(r, field)[layer] for r in records)


def test_without_an_ep_size_batch_passes_carry_no_ep_view(engine):
    result = engine.generate(GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=4,
                                               sampling=SamplingParams(temperature=0)),
                             DraftPolicy(Drafter.NGRAM, 3, policy_id="no-ep"))
    assert all(s.batch.ep_ranks_touched is None and s.batch.ep_dispatch_bytes is None for s in result.steps)
