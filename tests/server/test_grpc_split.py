"""Traffic split over real gRPC: seeded per-request arm assignment that follows the weights, every
response names the arm it ran, bad splits are INVALID_ARGUMENT naming the field, SetPolicy = one arm."""

from __future__ import annotations

import random

import grpc
import pytest
from scipy.stats import chisquare

from service.policy.traffic import ArmAssigner, TrafficArm, TrafficSplit
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.server.client import MoespecClient
from service.server.servicer import INVALID_FIELD_KEY, PolicyStore
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.tuner_fixtures import model_info

PLAIN = DraftPolicy(draft_length=0, policy_id="arm-plain")
NGRAM = DraftPolicy(Drafter.NGRAM, 3, 1.0, "arm-ngram")
MODEL = DraftPolicy(Drafter.MODEL, 2, 0.0, "arm-model")
SPLIT = TrafficSplit((TrafficArm(PLAIN, 0.6), TrafficArm(NGRAM, 0.3), TrafficArm(MODEL, 0.1)), seed=1234)


def chi_square_p(indices: list[int], shares: tuple[float, ...]) -> float:
    observed = [indices.count(i) for i in range(len(shares))]
    expected = [s * len(indices) for s in shares]
    return float(chisquare(observed, expected).pvalue)


def uniform_assigner_indices(split: TrafficSplit, n: int) -> list[int]:
    """Negative control: a wrong assigner that ignores the weights."""
    rng = random.Random(split.seed)
    return [rng.randrange(len(split.arms)) for _ in range(n)]


def test_assignment_follows_the_weights_and_a_weight_blind_assigner_fails_the_same_test():
    n = 3000
    assigner = ArmAssigner(SPLIT)
    indices = [assigner.next_index() for _ in range(n)]
    assert chi_square_p(indices, SPLIT.shares) > 0.001
    # The same test refuses an assigner that ignores the weights: it can fail.
    assert chi_square_p(uniform_assigner_indices(SPLIT, n), SPLIT.shares) < 1e-6


def test_same_seed_same_assignment_other_seed_other_assignment():
    a, b = ArmAssigner(SPLIT), ArmAssigner(SPLIT)
    assert [a.next_index() for _ in range(200)] == [b.next_index() for _ in range(200)]
    c = ArmAssigner(TrafficSplit(SPLIT.arms, seed=99))
    assert [ArmAssigner(SPLIT).next_index() for _ in range(200)] != [c.next_index() for _ in range(200)]


def test_every_response_names_its_arm_in_the_seeded_order_over_grpc(client, default_policy):
    stored = client.set_split(SPLIT)
    assert stored == SPLIT  # ids given, seed given: stored as sent
    replay = ArmAssigner(SPLIT)
    expected = [replay.next_policy() for _ in range(40)]
    request = GenerationRequest(prompt="def add(a, b):", max_new_tokens=2, sampling=SamplingParams(temperature=0.0))
    ran = [client.generate(request).spec for _ in range(40)]  # one at a time: the order is the draw order
    assert [s.policy_id for s in ran] == [p.policy_id for p in expected]
    for spec, policy in zip(ran, expected, strict=True):
        assert (spec.drafter, spec.draft_length) == (policy.drafter, policy.draft_length)
    assert {s.policy_id for s in ran} == {"arm-plain", "arm-ngram", "arm-model"}


def test_get_policy_is_the_first_arm_and_set_policy_is_one_arm_with_all_traffic(client, default_policy):
    client.set_split(SPLIT)
    assert client.get_policy() == PLAIN
    assert client.get_split().arms == SPLIT.arms
    client.set_policy(NGRAM)
    split = client.get_split()
    assert split.arms == (TrafficArm(NGRAM, 1.0),) and split.seed is not None


def test_unset_seed_is_filled_in_and_ids_are_derived(client, default_policy):
    stored = client.set_split(TrafficSplit((TrafficArm(DraftPolicy(policy_id=""), 1.0),
                                            TrafficArm(DraftPolicy(Drafter.NGRAM, 4, 1.0, ""), 2.0))))
    assert stored.seed is not None
    assert [a.policy.policy_id for a in stored.arms] == ["plain", "ngram-k4"]


def arm_pb(drafter=pb.DraftPolicy.MODEL, length=0, weight=1.0, policy_id="", temperature=None) -> pb.TrafficArm:
    policy = pb.DraftPolicy(drafter=drafter, draft_length=length, policy_id=policy_id)
    if temperature is not None:
        policy.draft_temperature = temperature
    return pb.TrafficArm(policy=policy, weight=weight)


@pytest.mark.parametrize(
    "arms, field",
    [
        ([], "split.arms"),
        ([arm_pb(policy_id=f"a{i}") for i in range(9)], "split.arms"),
        ([arm_pb(policy_id="a"), arm_pb(weight=0.0, policy_id="b")], "split.arms[1].weight"),
        ([arm_pb(weight=-1.0)], "split.arms[0].weight"),
        ([arm_pb(weight=float("nan"))], "split.arms[0].weight"),
        ([arm_pb(policy_id="a"), arm_pb(drafter=7, length=2, policy_id="b")], "split.arms[1].policy.drafter"),
        ([arm_pb(length=99)], "split.arms[0].policy.draft_length"),
        ([arm_pb(length=2, temperature=9.0)], "split.arms[0].policy.draft_temperature"),
        ([arm_pb(policy_id="same"), arm_pb(length=1, policy_id="same")], "split.arms[1].policy.policy_id"),
        ([pb.TrafficArm(weight=1.0)], "split.arms[0].policy"),
    ],
    ids=["empty", "too-many", "zero-weight", "negative-weight", "nan-weight", "unknown-drafter", "length",
         "temperature", "duplicate-id", "no-policy"],
)
def test_bad_split_is_invalid_argument_naming_the_field(server, stubs, arms, field):
    _, admin = stubs
    metadata = (("authorization", "Bearer test-admin-token"),)
    with pytest.raises(grpc.RpcError) as e:
        admin.SetTrafficSplit(pb.SetTrafficSplitRequest(split=pb.TrafficSplit(arms=arms)), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}: ")
    assert dict(e.value.trailing_metadata())[INVALID_FIELD_KEY] == field


def test_missing_split_and_missing_token(server, stubs):
    _, admin = stubs
    with pytest.raises(grpc.RpcError) as e:
        admin.SetTrafficSplit(pb.SetTrafficSplitRequest(), metadata=(("authorization", "Bearer test-admin-token"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("split: ")
    with MoespecClient(server.address) as anonymous:
        with pytest.raises(grpc.RpcError) as e:
            anonymous.set_split(SPLIT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_backend_that_runs_one_policy_at_a_time_refuses_several_arms_but_takes_one():
    store = PolicyStore(model_info(concurrent_policies=False), DraftPolicy(policy_id="default"), lambda: 5)
    with pytest.raises(Exception) as e:
        store.set_split(SPLIT)
    assert getattr(e.value, "field", "") == "split.arms" and "concurrent_policies" in str(e.value)
    assert store.set_split(TrafficSplit((TrafficArm(NGRAM, 3.0),))).primary == NGRAM


def test_engine_model_info_says_it_runs_policies_concurrently(client):
    assert client.model_info().concurrent_policies is True


def test_cli_sets_a_split_and_a_malformed_arm_is_exit_2(server, default_policy, capsys):
    from service.cli import main

    argv = ["client", "policy", "split", "--server", server.address, "--admin-token", "test-admin-token",
            "--arm", "0.9:model:0::ctl", "--arm", "0.1:ngram:4::cand", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert '"ctl"' in out and '"cand"' in out and '"seed": 3' in out
    with pytest.raises(SystemExit) as e:
        main(argv[:-4] + ["--arm", "0.5:banana:2"])
    assert e.value.code == 2
    assert "--arm '0.5:banana:2'" in capsys.readouterr().err
