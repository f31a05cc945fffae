"""PolicyAdmin: bearer-token auth, and the policy in force is the one current when a request starts."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from service.server.client import MoespecClient
from service.server.server import ServerConfig
from service.types import (
    Controller,
    Drafter,
    DraftPolicy,
    GenerationRequest,
    PolicyCell,
    RequestKind,
    SamplingParams,
)
from tests.conftest import ADMIN_TOKEN, ServerThread
from tests.support.engine_helpers import HoldingBackend

TRIAL = DraftPolicy(Drafter.NGRAM, 3, 1.0, "trial-7")


@pytest.fixture(scope="module")
def open_server(backend):
    """A server started without an admin token."""
    s = ServerThread(backend, ServerConfig(port=0, admin_token=None))
    yield s
    s.stop()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.mark.parametrize("token", [None, "wrong-token", "test-admin-token-but-longer", ""], ids=str)
def test_missing_or_wrong_token_is_unauthenticated_for_get_and_set(server, token):
    with MoespecClient(server.address, admin_token=token) as c:
        assert code_of(c.get_policy) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: c.set_policy(TRIAL)) == grpc.StatusCode.UNAUTHENTICATED


def test_non_bearer_authorization_is_unauthenticated(server, stubs):
    from service.proto_gen.moespec.v1 import moespec_pb2 as pb

    _, admin = stubs
    metadata = (("authorization", "Basic dGVzdC1hZG1pbi10b2tlbg=="),)
    assert code_of(lambda: admin.GetPolicy(pb.GetPolicyRequest(), metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED


def test_right_token_sets_and_gets_the_policy(client, default_policy):
    assert client.set_policy(TRIAL) == TRIAL
    assert client.get_policy() == TRIAL


def test_empty_policy_id_is_derived_from_the_fields(client, default_policy):
    stored = client.set_policy(DraftPolicy(Drafter.MODEL, 4, 0.5, ""))
    assert stored.policy_id == "model-k4-t0.5"


def test_requests_started_after_set_policy_run_under_it_and_report_it(client, default_policy):
    req = GenerationRequest(prompt="for i in range(", max_new_tokens=6, sampling=SamplingParams(seed=4))
    assert client.generate(req).spec.policy_id == "default"
    client.set_policy(TRIAL)
    spec = client.generate(req).spec
    assert (spec.policy_id, spec.drafter, spec.draft_length) == ("trial-7", Drafter.NGRAM, 3)
    client.set_policy(DraftPolicy(policy_id="plain"))
    spec = client.generate(req).spec
    assert (spec.policy_id, spec.draft_length, spec.drafted_tokens) == ("plain", 0, 0)


@pytest.fixture(scope="module")
def holding(engine) -> HoldingBackend:
    return HoldingBackend(engine)


@pytest.fixture(scope="module")
def held_server(holding):
    """A server whose requests can be held between two engine steps (see HoldingBackend)."""
    s = ServerThread(holding, ServerConfig(port=0, admin_token=ADMIN_TOKEN, max_queue=4))
    yield s
    s.stop()


def test_policy_set_mid_stream_does_not_change_a_running_request(holding, held_server):
    req = GenerationRequest(prompt="while True:", max_new_tokens=10, sampling=SamplingParams(seed=8))
    hold = holding.hold(seed=8, after_steps=2)
    with MoespecClient(held_server.address, admin_token=ADMIN_TOKEN) as c:
        stream = c.stream(req)
        next(stream)  # the request has started under the default policy
        assert hold.reached.wait(30)  # and is still running, by construction, while the policy changes
        assert c.set_policy(TRIAL) == TRIAL
        hold.release()
        final = [chunk for chunk in stream][-1].reply
        later = c.generate(dataclasses.replace(req, sampling=SamplingParams(seed=80)))
    assert final.spec.policy_id == "default" and final.spec.draft_length == 0
    assert final.spec.drafted_tokens == 0 and final.completion_tokens > 2  # steps after the change stayed plain
    assert (later.spec.policy_id, later.spec.drafter, later.spec.draft_length) == ("trial-7", Drafter.NGRAM, 3)


def test_without_a_configured_token_set_policy_is_refused_and_get_policy_is_open(open_server):
    with MoespecClient(open_server.address, admin_token="anything") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.set_policy(TRIAL)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin token" in e.value.details()
        assert c.get_policy().policy_id == "default"


def test_an_adaptive_policy_round_trips_and_its_requests_run_under_it(client, default_policy):
    """The controller and its weight travel through SetPolicy / GetPolicy and the derived id; the
    server offers every controller (GetModelInfo) and requests report the policy."""
    assert set(client.model_info().controllers) == set(Controller)
    policy = DraftPolicy(Drafter.NGRAM, 8, controller=Controller.MOESPEC, cost_weight=0.5, policy_id="")
    stored = client.set_policy(policy)
    assert stored == dataclasses.replace(policy, policy_id="moespec-ngram-k8-w0.5")
    assert client.get_policy() == stored
    reply = client.generate(GenerationRequest(prompt="a b c a b c a b c a b c", max_new_tokens=24,
                                              sampling=SamplingParams(temperature=0)))
    assert reply.spec.policy_id == "moespec-ngram-k8-w0.5" and reply.spec.draft_length == 8
    assert reply.spec.controller is Controller.MOESPEC


def test_a_table_policy_round_trips_and_its_steps_run_their_cell(client, default_policy):
    """Cells travel through SetPolicy / GetPolicy with the derived id naming each; a lone greedy
    request runs the one-request greedy cell, not the base."""
    assert client.model_info().policy_tables
    policy = DraftPolicy(policy_id="", cells=(
        PolicyCell(DraftPolicy(Drafter.NGRAM, 4), max_batch=1, kind=RequestKind.GREEDY),
        PolicyCell(DraftPolicy(Drafter.NGRAM, 8, controller=Controller.MOESPEC, cost_weight=2.0), min_batch=2)))
    stored = client.set_policy(policy)
    assert stored.policy_id == "plain+b1-1.greedy=ngram-k4+b2+.any=moespec-ngram-k8-w2"
    assert client.get_policy() == stored and stored.cells == policy.cells
    reply = client.generate(GenerationRequest(prompt="a b c a b c a b c a b c", max_new_tokens=24,
                                              sampling=SamplingParams(temperature=0)))
    assert reply.spec.policy_id == stored.policy_id
    assert reply.spec.drafted_tokens > 0  # the base is plain: only the cell drafts
    assert len(reply.spec.accepted_per_position) == 8  # the table's longest draft
