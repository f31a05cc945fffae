"""Spans of a real `moespec serve` in a real OTLP trace backend: Arize Phoenix (its own venv, built by
scripts/setup_phoenix.sh), receiving over OTLP/gRPC and queried through its REST API.

Phoenix finds the request spans of a draft policy by `moespec.spec.policy_id` (what a Tempo TraceQL
query or the tuner does) and returns their per-layer attributes intact: `unique_experts_mean` /
`_max` as arrays with one entry per MoE layer, equal to what the gRPC response reported, and equal
to what the trace's own `verify` spans add up to (every step gets a span here).
"""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from otel import attributes as a
from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.real_backends import http_json, start_phoenix, wait_until
from tuner.drivers.server_proc import start_server

TOKEN = "phoenix-test-token"
POLICIES = (DraftPolicy(Drafter.MODEL, 3, 0.0, policy_id="phx-model-3"), DraftPolicy(Drafter.NGRAM, 4,
                                                                                      policy_id="phx-ngram-4"))
PROMPTS = ("def add(a, b):\n", "import os\n\ndef main():\n")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    backend, url, otlp = start_phoenix(tmp_path_factory.mktemp("phoenix"))
    try:
        yield url, otlp
    finally:
        backend.stop()


@pytest.fixture(scope="module")
def served(phoenix):
    """Requests through `moespec serve` exporting to Phoenix -> (Phoenix URL, model info, replies by policy)."""
    url, otlp = phoenix
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "MOESPEC_VERIFY_SPAN_RATIO": "1"}
    server = start_server(env, TOKEN, ("--threads", "1"))
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=60)
            info = client.model_info()
            replies = {}
            for policy in POLICIES:
                client.set_policy(policy)
                requests = [GenerationRequest(prompt=p, max_new_tokens=20, sampling=SamplingParams(temperature=0))
                            for p in PROMPTS]
                replies[policy.policy_id] = [client.generate(r) for r in requests]
        yield url, info, replies
    finally:
        server.stop()


def spans(url: str, **filters) -> list[dict]:
    params = [("limit", "1000")] + [(k, v) for k, values in filters.items() for v in values]
    return http_json(f"{url}/v1/projects/default/spans?{urlencode(params)}")["data"]


def spans_when(url: str, count: int, **filters) -> list[dict]:
    """The filtered spans once at least `count` have been ingested (export and ingestion are batched)."""
    def enough() -> list[dict] | None:
        found = spans(url, **filters)
        return found if len(found) >= count else None

    return wait_until(enough, timeout=30, what=f"{count} spans matching {filters}")


def request_spans_of(url: str, policy_id: str, count: int) -> list[dict]:
    """Phoenix's attribute filter, the way one finds a policy's requests in any trace backend."""
    return spans_when(url, count, attribute=[f"{a.SPEC_POLICY_ID}:{policy_id}"])


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.policy_id)
def test_phoenix_finds_the_request_spans_with_per_layer_unique_experts(served, policy):
    url, info, replies = served
    found = request_spans_of(url, policy.policy_id, len(replies[policy.policy_id]))
    by_trace = {s["context"]["trace_id"]: s for s in found}
    assert len(found) == len(by_trace) == len(replies[policy.policy_id])  # one request span per request
    for reply in replies[policy.policy_id]:
        span = by_trace[reply.trace_id]
        attrs, spec = span["attributes"], reply.spec
        assert span["name"] == a.request_span_name(info.model_name)
        mean, worst = attrs[a.MOE_UNIQUE_EXPERTS_MEAN], attrs[a.MOE_UNIQUE_EXPERTS_MAX]
        assert len(mean) == len(worst) == info.num_layers
        assert mean == pytest.approx(list(spec.unique_experts_mean), rel=1e-12)
        assert worst == list(spec.unique_experts_max)
        assert all(info.top_k <= m <= w <= info.num_experts for m, w in zip(mean, worst, strict=True))
        assert (attrs[a.SPEC_DRAFTER], attrs[a.SPEC_DRAFT_LENGTH]) == (policy.drafter.value, policy.draft_length)
        for key, value in ((a.SPEC_VERIFY_STEPS, spec.verify_steps), (a.SPEC_DRAFTED_TOKENS, spec.drafted_tokens),
                           (a.SPEC_ACCEPTED_TOKENS, spec.accepted_tokens),
                           (a.SPEC_COMMITTED_TOKENS, spec.committed_tokens),
                           (a.GEN_AI_USAGE_OUTPUT_TOKENS, reply.completion_tokens)):
            assert attrs[key] == value, key


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.policy_id)
def test_the_trace_verify_spans_add_up_to_the_request_aggregates(served, policy):
    url, info, replies = served
    for reply in replies[policy.policy_id]:
        spec = reply.spec
        trace = spans_when(url, spec.verify_steps + 2, trace_id=[reply.trace_id])  # + request and server spans
        (request,) = [s for s in trace if s["name"] == a.request_span_name(info.model_name)]
        (server_span,) = [s for s in trace if s["context"]["span_id"] == request["parent_id"]]
        assert server_span["name"].endswith("/Generate")  # the gRPC server span is the parent
        verify = [s for s in trace if s["name"] == a.VERIFY_SPAN_NAME]
        assert len(verify) == spec.verify_steps
        assert all(s["parent_id"] == request["context"]["span_id"] for s in verify)
        per_step = [s["attributes"][a.MOE_UNIQUE_EXPERTS] for s in verify]
        assert all(len(u) == info.num_layers for u in per_step)
        mean = [sum(u[i] for u in per_step) / len(per_step) for i in range(info.num_layers)]
        assert mean == pytest.approx(request["attributes"][a.MOE_UNIQUE_EXPERTS_MEAN], rel=1e-12)
        assert [max(u[i] for u in per_step) for i in range(info.num_layers)] == \
            request["attributes"][a.MOE_UNIQUE_EXPERTS_MAX]
        assert sum(s["attributes"][a.SPEC_COMMITTED_TOKENS] for s in verify) == spec.committed_tokens
