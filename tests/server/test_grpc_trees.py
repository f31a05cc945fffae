"""Draft trees on the wire: DraftPolicy.tree_width, ModelInfo.max_tree_width and the tree fields of
SpecStats convert both ways, and the server refuses a tree wider than its backend drafts before any
work, on every path that sets a policy (the initial policy, SetPolicy and its table cells, traffic
splits), naming the field. Two real servers on the session's engine: one whose backend says it drafts
chains only (as the SGLang backend does), one that says it drafts trees up to width 2."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.server import convert
from service.server.server import MoespecServer, ServerConfig
from service.server.servicer import INVALID_FIELD_KEY
from service.types import Drafter, DraftPolicy, GenerationRequest, InvalidRequest, SamplingParams, SpecStats
from tests.conftest import ADMIN_TOKEN, RecordingBackend, ServerThread

AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
TREE = pb.DraftPolicy(drafter=pb.DraftPolicy.MODEL, draft_length=6, draft_temperature=0.0, tree_width=2)
OK = pb.GenerateRequest(prompt="x = 1", max_new_tokens=2, sampling=pb.SamplingParams(seed=1))


def backend_drafting(engine, max_tree_width: int) -> RecordingBackend:
    """The session's engine, behind a backend that reports the given widest tree."""
    backend = RecordingBackend(engine)
    backend.info = dataclasses.replace(engine.info, max_tree_width=max_tree_width)
    return backend


WIDTHS = pytest.mark.parametrize("width", [1, 2], ids=["chains-only", "width-2"])


@pytest.fixture(scope="module")
def servers(engine):
    """Backend width -> (Inference stub, PolicyAdmin stub) of a server on it."""
    running = {w: ServerThread(backend_drafting(engine, w), ServerConfig(port=0, admin_token=ADMIN_TOKEN))
               for w in (1, 2)}
    channels = {w: grpc.insecure_channel(s.address) for w, s in running.items()}
    try:
        yield {w: (pb_grpc.InferenceStub(c), pb_grpc.PolicyAdminStub(c)) for w, c in channels.items()}
    finally:
        for w, server in running.items():
            channels[w].close()
            server.stop()


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value


def assert_names(err: grpc.RpcError, field: str) -> None:
    assert err.details().startswith(f"{field}:"), err.details()
    assert (INVALID_FIELD_KEY, field) in tuple(err.trailing_metadata())


@WIDTHS
def test_model_info_reports_the_widest_tree(servers, width):
    inference, _ = servers[width]
    assert inference.GetModelInfo(pb.GetModelInfoRequest()).max_tree_width == width


@WIDTHS
def test_a_tree_wider_than_the_backend_drafts_is_refused_on_every_path_and_nothing_changes(servers, width):
    inference, admin = servers[width]
    before = admin.GetTrafficSplit(pb.GetTrafficSplitRequest(), metadata=AUTH)
    too_wide = dataclasses.replace(convert.policy_from_pb(TREE), tree_width=width + 1)
    wide = convert.policy_to_pb(too_wide)
    err = refused(lambda: admin.SetPolicy(pb.SetPolicyRequest(policy=wide), metadata=AUTH))
    assert_names(err, "policy.tree_width")
    assert ("drafts chains only" if width == 1 else f"drafts trees up to width {width}") in err.details()
    cell = pb.DraftPolicy(cells=[pb.PolicyCell(kind=pb.PolicyCell.GREEDY, policy=wide)])
    assert_names(refused(lambda: admin.SetPolicy(pb.SetPolicyRequest(policy=cell), metadata=AUTH)),
                 "policy.cells[0].policy.tree_width")
    split = pb.TrafficSplit(arms=[pb.TrafficArm(policy=pb.DraftPolicy(policy_id="a"), weight=1.0),
                                  pb.TrafficArm(policy=wide, weight=1.0)])
    assert_names(refused(lambda: admin.SetTrafficSplit(pb.SetTrafficSplitRequest(split=split), metadata=AUTH)),
                 "split.arms[1].policy.tree_width")
    assert admin.GetTrafficSplit(pb.GetTrafficSplitRequest(), metadata=AUTH) == before
    assert inference.Generate(OK, timeout=60).completion_tokens > 0


def test_a_tree_the_backend_drafts_is_stored_under_an_id_that_names_its_width(servers):
    _, admin = servers[2]
    try:
        stored = admin.SetPolicy(pb.SetPolicyRequest(policy=TREE), metadata=AUTH)
        assert (stored.tree_width, stored.policy_id) == (2, "model-k6-t0-tw2")
        assert admin.GetPolicy(pb.GetPolicyRequest(), metadata=AUTH) == stored
        arms = [pb.TrafficArm(policy=pb.DraftPolicy(draft_length=6, draft_temperature=0.0), weight=1.0),
                pb.TrafficArm(policy=TREE, weight=1.0)]
        split = admin.SetTrafficSplit(pb.SetTrafficSplitRequest(split=pb.TrafficSplit(arms=arms)), metadata=AUTH)
        assert [(a.policy.policy_id, a.policy.tree_width) for a in split.arms] == [("model-k6-t0", 0),
                                                                                  ("model-k6-t0-tw2", 2)]
    finally:
        admin.SetPolicy(pb.SetPolicyRequest(policy=pb.DraftPolicy(policy_id="default")), metadata=AUTH)


@WIDTHS
def test_a_chain_goes_out_as_an_unset_width_and_an_unset_width_is_a_chain(servers, width):
    """Older clients send no tree_width (0): a chain. A chain is sent as 0, so chain policies, and the
    stats of chain requests, are on the wire what they were before trees."""
    inference, admin = servers[width]
    stored = admin.SetPolicy(pb.SetPolicyRequest(policy=pb.DraftPolicy(draft_length=2)), metadata=AUTH)
    try:
        assert "tree_width" not in {f.name for f, _ in stored.ListFields()}
        assert convert.policy_from_pb(stored).tree_width == 1
        spec = inference.Generate(OK, timeout=60).spec
        assert {"tree_width", "branch_unique_experts_mean"}.isdisjoint(f.name for f, _ in spec.ListFields())
        assert convert.spec_from_pb(spec).tree_width == 1
    finally:
        admin.SetPolicy(pb.SetPolicyRequest(policy=pb.DraftPolicy(policy_id="default")), metadata=AUTH)


def test_the_initial_policy_is_checked_before_the_server_starts(engine):
    tree = DraftPolicy(Drafter.MODEL, 6, 0.0, "default", tree_width=3)
    with pytest.raises(InvalidRequest) as e:
        MoespecServer(backend_drafting(engine, 2), ServerConfig(port=0, initial_policy=tree))
    assert e.value.field == "policy.tree_width"


# -- conversion, both ways --------------------------------------------------------------------------


def test_tree_fields_round_trip(engine):
    policy = DraftPolicy(Drafter.MODEL, 6, 0.5, "mine", tree_width=3)
    assert convert.policy_from_pb(convert.policy_to_pb(policy)) == policy
    info = dataclasses.replace(engine.info, max_tree_width=4)
    assert convert.info_from_pb(convert.info_to_pb(info)) == info
    L = engine.info.num_layers
    spec = SpecStats(verify_steps=2, drafted_tokens=12, accepted_tokens=3, committed_tokens=5,
                     accepted_per_position=(2, 1, 0, 0, 0, 0), unique_experts_mean=(20.0,) * L,
                     unique_experts_max=(24,) * L, draft_seconds=0.01, verify_seconds=0.02, empty_drafts=0,
                     policy_id="mine", drafter=Drafter.MODEL, draft_length=6, draft_temperature=0.5,
                     tree_width=3, branch_unique_experts_mean=(13.5,) * L)
    assert convert.spec_from_pb(convert.spec_to_pb(spec)) == spec


def test_a_server_that_predates_trees_reads_as_chains_only():
    assert convert.info_from_pb(pb.ModelInfo()).max_tree_width == 1
    assert convert.policy_from_pb(pb.DraftPolicy(draft_length=3)).tree_width == 1
    assert convert.spec_from_pb(pb.SpecStats()).tree_width == 1


# -- a tree request end to end, on the session's server ----------------------------------------------


def test_a_tree_request_over_grpc_reports_its_width_and_branch_unions_and_generates_the_plain_output(
        client, engine, default_policy):
    assert engine.info.max_tree_width >= 2  # the embedded engine drafts trees with its draft head
    request = GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=16, sampling=SamplingParams(temperature=0))
    plain = client.generate(request)
    client.set_policy(DraftPolicy(Drafter.MODEL, 6, 0.0, "", tree_width=2))
    reply = client.generate(request)
    spec = reply.spec
    assert reply.token_ids == plain.token_ids  # lossless: greedy output is plain decoding's
    assert (spec.policy_id, spec.tree_width) == ("model-k6-t0-tw2", 2)
    assert sum(spec.accepted_per_position) == spec.accepted_tokens  # by depth along the accepted paths
    L = engine.info.num_layers
    assert len(spec.branch_unique_experts_mean) == len(spec.unique_experts_mean) == L
    # one branch never touches more than the whole tree
    assert all(b <= u for b, u in zip(spec.branch_unique_experts_mean, spec.unique_experts_mean, strict=True))
    assert (plain.spec.tree_width, plain.spec.branch_unique_experts_mean) == (1, ())
