"""What the proto comments promise a client, checked over a real gRPC channel: the response says
when max_new_tokens was cut to the context's room after the prompt, and the torch backend says
where it computes."""

from __future__ import annotations

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.types import InvalidRequest, SamplingParams

GREEDY = pb.SamplingParams(temperature=0.0)


def generate_both_ways(inference, request: pb.GenerateRequest):
    """The unary response and the stream's final chunk for the same request."""
    response = inference.Generate(request, timeout=60)
    final = list(inference.GenerateStream(request, timeout=60))[-1]
    return response, final


def test_a_budget_cut_to_the_context_room_is_reported(stubs, client):
    inference, _ = stubs
    max_context = client.model_info().max_context
    prompt = [7] * (max_context - 12)  # leaves room for 12 new tokens
    for reply in generate_both_ways(inference, pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=32,
                                                                  sampling=GREEDY)):
        assert reply.prompt_tokens == len(prompt)
        assert (reply.max_new_tokens, reply.max_new_tokens_cut) == (12, True)
        assert reply.completion_tokens <= 12
        if reply.finish_reason == "length":
            assert reply.completion_tokens == 12


@pytest.mark.parametrize(("asked", "expected"), [(5, 5), (None, 64)])
def test_a_budget_that_fits_is_reported_uncut(stubs, asked, expected):
    inference, _ = stubs
    request = pb.GenerateRequest(prompt="def f(x):", sampling=GREEDY)
    if asked is not None:
        request.max_new_tokens = asked
    for reply in generate_both_ways(inference, request):
        assert (reply.max_new_tokens, reply.max_new_tokens_cut) == (expected, False)
        assert reply.completion_tokens <= expected


def test_a_budget_exactly_the_room_is_not_a_cut(stubs, client):
    inference, _ = stubs
    max_context = client.model_info().max_context
    reply = inference.Generate(pb.GenerateRequest(prompt_token_ids=[7] * (max_context - 3), max_new_tokens=3,
                                                  sampling=GREEDY), timeout=60)
    assert (reply.max_new_tokens, reply.max_new_tokens_cut) == (3, False)


def test_the_torch_backend_reports_its_device(client):
    info = client.model_info()
    assert (info.backend, info.device) == ("torch", "cpu")


@pytest.mark.parametrize("seed", [-1, 2**63 - 1])
def test_the_documented_seed_range_holds_at_its_ends(stubs, seed):
    inference, _ = stubs
    request = pb.GenerateRequest(prompt="x", max_new_tokens=1, sampling=pb.SamplingParams(seed=seed))
    if seed < 0:
        with pytest.raises(grpc.RpcError) as e:
            inference.Generate(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 2^63)" in e.value.details()
        with pytest.raises(InvalidRequest):
            SamplingParams(seed=seed).validate()
    else:
        assert inference.Generate(request, timeout=30).completion_tokens == 1


def test_with_a_stop_string_text_ends_before_it_and_token_ids_hold_the_token_that_completed_it(stubs, engine):
    inference, _ = stubs
    request = pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=24, sampling=GREEDY)
    free = inference.Generate(request, timeout=60).text
    stop = free[len(free) // 2:len(free) // 2 + 3]  # a string the greedy output is known to reach
    assert len(stop.strip()) >= 2
    request.stop.append(stop)
    reply = inference.Generate(request, timeout=60)
    assert reply.finish_reason == "stop"
    assert reply.text == free[:free.index(stop)] and stop not in reply.text
    decoded = engine.tokenizer.decode(list(reply.token_ids))
    assert stop in decoded and decoded.startswith(reply.text)
    assert reply.completion_tokens == len(reply.token_ids)
