"""Bad input is refused at the edge with the right status and field, and the server keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.server.servicer import INVALID_FIELD_KEY
from tests.conftest import ADMIN_TOKEN

AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
OK = pb.GenerateRequest(prompt="x = 1", max_new_tokens=2, sampling=pb.SamplingParams(seed=1))


def gen(**fields) -> pb.GenerateRequest:
    sampling = fields.pop("sampling", {})
    return pb.GenerateRequest(**{"prompt": "x = 1", "max_new_tokens": 2, **fields},
                              sampling=pb.SamplingParams(**sampling))


# (case id, request, field the error must name)
BAD_GENERATE = [
    ("empty prompt", gen(prompt=""), "prompt"),
    ("prompt and token ids", gen(prompt_token_ids=[1, 2]), "prompt"),
    ("text prompt over the context", gen(prompt="a b c d " * 600), "prompt"),
    ("token prompt over the context", gen(prompt="", prompt_token_ids=[5] * 600), "prompt_token_ids"),
    ("max_new_tokens 0", gen(max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens negative", gen(max_new_tokens=-3), "max_new_tokens"),
    ("max_new_tokens over the limit", gen(max_new_tokens=100_000), "max_new_tokens"),
    ("temperature NaN", gen(sampling={"temperature": math.nan}), "sampling.temperature"),
    ("temperature negative", gen(sampling={"temperature": -0.5}), "sampling.temperature"),
    ("temperature inf", gen(sampling={"temperature": math.inf}), "sampling.temperature"),
    ("top_p 0", gen(sampling={"top_p": 0.0}), "sampling.top_p"),
    ("top_p over 1", gen(sampling={"top_p": 1.5}), "sampling.top_p"),
    ("top_p NaN", gen(sampling={"top_p": math.nan}), "sampling.top_p"),
    ("top_k negative", gen(sampling={"top_k": -1}), "sampling.top_k"),
    ("seed negative", gen(sampling={"seed": -1}), "sampling.seed"),
    ("token id over the vocabulary", gen(prompt="", prompt_token_ids=[1, 4096]), "prompt_token_ids"),
    ("token id negative", gen(prompt="", prompt_token_ids=[-1]), "prompt_token_ids"),
    ("too many stop strings", gen(stop=[f"s{i}" for i in range(9)]), "stop"),
    ("stop string too long", gen(stop=["x" * 65]), "stop"),
    ("empty stop string", gen(stop=[""]), "stop"),
]

BAD_POLICY = [
    ("draft_length over the max", pb.DraftPolicy(draft_length=9), "policy.draft_length"),
    ("draft_length negative", pb.DraftPolicy(draft_length=-1), "policy.draft_length"),
    ("draft_temperature negative", pb.DraftPolicy(draft_length=2, draft_temperature=-0.1), "policy.draft_temperature"),
    ("draft_temperature too high", pb.DraftPolicy(draft_length=2, draft_temperature=2.5), "policy.draft_temperature"),
    ("draft_temperature NaN", pb.DraftPolicy(draft_length=2, draft_temperature=math.nan), "policy.draft_temperature"),
    ("unknown drafter", pb.DraftPolicy(drafter=7, draft_length=2), "policy.drafter"),
    ("policy_id too long", pb.DraftPolicy(draft_length=2, policy_id="p" * 129), "policy.policy_id"),
    ("unknown controller", pb.DraftPolicy(draft_length=2, controller=9), "policy.controller"),
    ("cost_weight 0", pb.DraftPolicy(draft_length=2, controller=pb.DraftPolicy.MOESPEC, cost_weight=0.0),
     "policy.cost_weight"),
    ("cost_weight NaN", pb.DraftPolicy(draft_length=2, controller=pb.DraftPolicy.MOESPEC, cost_weight=math.nan),
     "policy.cost_weight"),
    ("cost_weight too high", pb.DraftPolicy(draft_length=2, controller=pb.DraftPolicy.MOESPEC, cost_weight=101.0),
     "policy.cost_weight"),
    # trees: refused whatever widths the backend drafts (the n-gram drafter and the adaptive controllers
    # plan chains; 4 is the most any backend takes)
    ("tree_width negative", pb.DraftPolicy(draft_length=4, tree_width=-1), "policy.tree_width"),
    ("tree_width over the max", pb.DraftPolicy(draft_length=4, tree_width=5), "policy.tree_width"),
    ("tree of the n-gram drafter", pb.DraftPolicy(drafter=pb.DraftPolicy.NGRAM, draft_length=4, tree_width=2),
     "policy.tree_width"),
    ("tree under an adaptive controller", pb.DraftPolicy(draft_length=4, controller=pb.DraftPolicy.CASCADE,
                                                         tree_width=2), "policy.tree_width"),
    # tables: the field named is the cell's
    ("cell min_batch negative", pb.DraftPolicy(cells=[pb.PolicyCell(min_batch=-2)]), "policy.cells[0].min_batch"),
    ("cell max_batch below min_batch", pb.DraftPolicy(cells=[pb.PolicyCell(min_batch=4, max_batch=2)]),
     "policy.cells[0].max_batch"),
    ("cell kind unknown", pb.DraftPolicy(cells=[pb.PolicyCell(kind=5)]), "policy.cells[0].kind"),
    ("cell draft_length over the max", pb.DraftPolicy(cells=[pb.PolicyCell(policy=pb.DraftPolicy(draft_length=9))]),
     "policy.cells[0].policy.draft_length"),
    ("cell cost_weight 0", pb.DraftPolicy(cells=[pb.PolicyCell(policy=pb.DraftPolicy(
        draft_length=2, controller=pb.DraftPolicy.MOESPEC, cost_weight=0.0))]), "policy.cells[0].policy.cost_weight"),
    ("cells overlap", pb.DraftPolicy(cells=[pb.PolicyCell(max_batch=4, kind=pb.PolicyCell.GREEDY),
                                            pb.PolicyCell(min_batch=3)]), "policy.cells[1]"),
    ("cell inside a cell", pb.DraftPolicy(cells=[pb.PolicyCell(policy=pb.DraftPolicy(cells=[pb.PolicyCell()]))]),
     "policy.cells[0].policy.cells"),
    ("too many cells", pb.DraftPolicy(cells=[pb.PolicyCell(min_batch=i, max_batch=i) for i in range(1, 18)]),
     "policy.cells"),
    ("cell tree of the n-gram drafter", pb.DraftPolicy(cells=[pb.PolicyCell(policy=pb.DraftPolicy(
        drafter=pb.DraftPolicy.NGRAM, draft_length=4, tree_width=3))]), "policy.cells[0].policy.tree_width"),
]


def assert_invalid(err: grpc.RpcError, field: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()
    assert (INVALID_FIELD_KEY, field) in tuple(err.trailing_metadata())


def assert_still_serving(inference) -> None:
    assert inference.Generate(OK, timeout=60).completion_tokens > 0


@pytest.mark.parametrize(("case", "msg", "field"), BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_field_is_invalid_argument_naming_it_and_serving_continues(stubs, case, msg, field):
    inference, _ = stubs
    with pytest.raises(grpc.RpcError) as e:
        inference.Generate(msg, timeout=60)
    assert_invalid(e.value, field)
    assert_still_serving(inference)


@pytest.mark.parametrize(("case", "msg", "field"), BAD_GENERATE[:3], ids=[c[0] for c in BAD_GENERATE[:3]])
def test_bad_stream_request_is_invalid_argument_too(stubs, case, msg, field):
    inference, _ = stubs
    with pytest.raises(grpc.RpcError) as e:
        list(inference.GenerateStream(msg, timeout=60))
    assert_invalid(e.value, field)
    assert_still_serving(inference)


@pytest.mark.parametrize(("case", "msg", "field"), BAD_POLICY, ids=[c[0] for c in BAD_POLICY])
def test_policy_out_of_bounds_is_invalid_argument_and_leaves_the_policy_unchanged(stubs, case, msg, field):
    inference, admin = stubs
    before = admin.GetPolicy(pb.GetPolicyRequest(), metadata=AUTH)
    with pytest.raises(grpc.RpcError) as e:
        admin.SetPolicy(pb.SetPolicyRequest(policy=msg), metadata=AUTH)
    assert_invalid(e.value, field)
    assert admin.GetPolicy(pb.GetPolicyRequest(), metadata=AUTH) == before
    assert_still_serving(inference)


def test_set_policy_without_a_policy_is_invalid_argument(stubs):
    _, admin = stubs
    with pytest.raises(grpc.RpcError) as e:
        admin.SetPolicy(pb.SetPolicyRequest(), metadata=AUTH)
    assert_invalid(e.value, "policy")


def test_oversized_message_is_refused_by_the_size_limit_and_serving_continues(stubs):
    inference, _ = stubs
    with pytest.raises(grpc.RpcError) as e:
        inference.Generate(gen(prompt="x" * (2 << 20)), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_serving(inference)
