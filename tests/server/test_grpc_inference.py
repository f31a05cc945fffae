"""Inference over real gRPC: every RPC answers, streaming equals unary, concurrency changes nothing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.server import convert
from service.types import Drafter, DraftPolicy, FinishReason, GenerationRequest, SamplingParams

PROMPT = "def add(a, b):"


def request(seed: int, max_new_tokens: int = 8, prompt: str = PROMPT, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(seed=seed), **kw)


def collect_stream(client, req):
    chunks = list(client.stream(req))
    return chunks, chunks[-1].reply


def test_generate_returns_text_tokens_counts_and_spec_stats(client, engine):
    reply = client.generate(request(seed=1))
    assert reply.completion_tokens == len(reply.token_ids) <= 8
    assert reply.prompt_tokens > 0
    assert reply.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert reply.spec.policy_id == "default"
    assert reply.spec.committed_tokens == reply.completion_tokens
    assert len(reply.spec.unique_experts_mean) == engine.info.num_layers
    assert all(engine.info.top_k <= u <= engine.info.num_experts for u in reply.spec.unique_experts_max)
    assert reply.seconds > 0 and reply.trace_id == ""  # no telemetry configured on this server


def test_generate_matches_the_in_process_engine_for_a_fixed_seed(client, engine):
    req = request(seed=7)
    local = engine.generate(req, DraftPolicy(policy_id="default"))
    remote = client.generate(req)
    assert (remote.text, remote.token_ids, remote.finish_reason) == (local.text, local.token_ids, local.finish_reason)


def test_model_info_describes_the_backend(client, engine):
    info = client.model_info()
    assert info == engine.info


@pytest.mark.parametrize(
    "policy",
    [
        DraftPolicy(policy_id="default"),
        DraftPolicy(Drafter.MODEL, 3, 0.8, "m3"),
        DraftPolicy(Drafter.NGRAM, 2, 1.0, "n2"),
    ],
    ids=["plain", "model-k3", "ngram-k2"],
)
def test_stream_equals_unary_for_a_fixed_seed(client, policy, default_policy):
    client.set_policy(policy)
    req = request(seed=11, max_new_tokens=12)
    unary = client.generate(req)
    chunks, final = collect_stream(client, req)
    assert "".join(c.text for c in chunks) == unary.text == final.text
    assert tuple(t for c in chunks for t in c.token_ids) == unary.token_ids == final.token_ids
    assert final.finish_reason == unary.finish_reason
    assert final.completion_tokens == unary.completion_tokens
    # Counts and expert unions are exact; timings naturally differ between two runs.
    untimed = dict(draft_seconds=0.0, verify_seconds=0.0)
    assert replace(final.spec, **untimed) == replace(unary.spec, **untimed)
    assert final.spec.policy_id == policy.policy_id


def test_stream_with_a_stop_string_equals_unary(client):
    free = client.generate(request(seed=3, max_new_tokens=16))
    stop = free.text[6:9]  # a string this seed really produces, so the stop must fire
    assert stop.strip(), free.text
    req = request(seed=3, max_new_tokens=16, stop=(stop,))
    unary = client.generate(req)
    chunks, final = collect_stream(client, req)
    assert "".join(c.text for c in chunks) == unary.text == final.text == free.text[:free.text.index(stop)]
    assert final.finish_reason == unary.finish_reason == FinishReason.STOP


def test_stream_sends_tokens_before_the_final_chunk(client):
    chunks, final = collect_stream(client, request(seed=5, max_new_tokens=6))
    token_chunks = [c for c in chunks[:-1] if c.token_ids]
    assert token_chunks, "no token arrived before the summary"
    assert all(c.reply is None for c in chunks[:-1]) and final is not None


def test_sixteen_concurrent_streams_get_what_they_get_alone(client):
    reqs = [request(seed=100 + i, max_new_tokens=6) for i in range(16)]
    alone = [client.generate(r) for r in reqs]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda r: collect_stream(client, r)[1], reqs))
    for a, t in zip(alone, together, strict=True):
        assert (t.text, t.token_ids, t.finish_reason) == (a.text, a.token_ids, a.finish_reason)


def test_token_id_prompt_is_accepted(client, engine):
    ids = tuple(engine.tokenizer.encode(PROMPT).ids)
    by_ids = client.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=5, sampling=SamplingParams(seed=2)))
    by_text = client.generate(request(seed=2, max_new_tokens=5))
    assert by_ids.token_ids == by_text.token_ids


def test_unset_optional_fields_take_the_defaults_not_zero(stubs, engine):
    inference, _ = stubs
    reply = inference.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, sampling=pb.SamplingParams(seed=9)))
    local = engine.generate(request(seed=9, max_new_tokens=4), DraftPolicy())  # temperature 1, top_p 1, top_k 0
    assert tuple(reply.token_ids) == local.token_ids
    assert convert.request_from_pb(pb.GenerateRequest(prompt=PROMPT)) == GenerationRequest(prompt=PROMPT)
    assert convert.policy_from_pb(pb.DraftPolicy(draft_length=2)).draft_temperature == 1.0
