"""Policy ids are canonical: policies that run the same way get one derived id (the server's, over
gRPC) and one tuner group, however the fields their drafter ignores are set."""

from __future__ import annotations

import pytest

from service.policy.ids import canonical, cell_from_text, derived_id, policy_from_id
from service.types import MAX_TREE_WIDTH, Controller, Drafter, DraftPolicy, InvalidRequest
from tuner.loop.space import policy_key

# (policy, derived id): each group of equal ids runs one policy.
CASES = [
    (DraftPolicy(Drafter.NGRAM, 4, 0.0, ""), "ngram-k4"),
    (DraftPolicy(Drafter.NGRAM, 4, 1.0, ""), "ngram-k4"),
    (DraftPolicy(Drafter.NGRAM, 4, 1.7, ""), "ngram-k4"),
    (DraftPolicy(Drafter.MODEL, 0, 0.5, ""), "plain"),
    (DraftPolicy(Drafter.NGRAM, 0, 0.0, ""), "plain"),
    (DraftPolicy(Drafter.MODEL, 0, 1.0, ""), "plain"),
    (DraftPolicy(Drafter.MODEL, 4, 0.5, ""), "model-k4-t0.5"),
    (DraftPolicy(Drafter.MODEL, 4, 0.0, ""), "model-k4-t0"),
    (DraftPolicy(Drafter.MODEL, 2, 1.0, ""), "model-k2-t1"),
    (DraftPolicy(Drafter.MODEL, 2, 1.0, "", Controller.STATIC, 3.0), "model-k2-t1"),  # the weight is moespec's
    (DraftPolicy(Drafter.NGRAM, 0, 1.0, "", Controller.CASCADE), "plain"),  # nothing to choose
    (DraftPolicy(Drafter.NGRAM, 8, 0.3, "", Controller.CASCADE, 2.0), "cascade-ngram-k8"),
    (DraftPolicy(Drafter.NGRAM, 8, 1.0, "", Controller.CASCADE), "cascade-ngram-k8"),
    (DraftPolicy(Drafter.NGRAM, 8, 1.0, "", Controller.SGLANG), "sglang-ema-ngram-k8"),
    (DraftPolicy(Drafter.MODEL, 8, 0.0, "", Controller.MOESPEC), "moespec-model-k8-t0-w1"),
    (DraftPolicy(Drafter.MODEL, 8, 0.0, "", Controller.MOESPEC, 1.5), "moespec-model-k8-t0-w1.5"),
    (DraftPolicy(Drafter.MODEL, 8, 0.0, "", Controller.TRANSFORMERS), "transformers-heuristic-model-k8-t0"),
    (DraftPolicy(Drafter.MODEL, 6, 0.5, "", tree_width=2), "model-k6-t0.5-tw2"),
    (DraftPolicy(Drafter.MODEL, 6, 0.5, "", tree_width=1), "model-k6-t0.5"),  # a chain: today's id
    (DraftPolicy(Drafter.MODEL, 6, 0.0, "", tree_width=4), "model-k6-t0-tw4"),
    (DraftPolicy(Drafter.MODEL, 0, 0.5, "", tree_width=3), "plain"),  # nothing drafted: no tree
]


def case_id(p: DraftPolicy) -> str:
    return f"{p.controller}-{p.drafter.value}-{p.draft_length}-{p.draft_temperature}-{p.cost_weight}-{p.tree_width}"


@pytest.mark.parametrize(("policy", "expected"), CASES, ids=[case_id(p) for p, _ in CASES])
def test_the_derived_id_ignores_what_the_drafter_ignores(policy, expected):
    assert derived_id(policy) == expected


def test_policies_with_one_id_are_one_canonical_policy_and_one_tuner_group():
    by_id: dict[str, set] = {}
    for policy, expected in CASES:
        by_id.setdefault(expected, set()).add((canonical(policy), policy_key(policy)))
    assert all(len(forms) == 1 for forms in by_id.values()), by_id
    # and different ids really are different policies
    assert len({next(iter(forms)) for forms in by_id.values()}) == len(by_id)


def test_canonical_keeps_what_matters():
    p = DraftPolicy(Drafter.MODEL, 3, 0.7, "mine")
    assert canonical(p) == p
    assert canonical(DraftPolicy(Drafter.NGRAM, 3, 0.0, "x")) == DraftPolicy(Drafter.NGRAM, 3, 1.0, "x")


@pytest.mark.parametrize(("policy", "expected"), [c for c in CASES if c[0].draft_length == 0 or
                                                  c[0].drafter is Drafter.NGRAM][:4])
def test_the_server_derives_canonical_ids_over_grpc(client, default_policy, policy, expected):
    assert client.set_policy(policy).policy_id == expected


def test_every_derived_id_parses_back_to_a_policy_with_that_id():
    """policy_from_id inverts derived_id (the CLI's --cell reads ids), table cells by their labels."""
    ids = set()
    for controller in Controller:
        for drafter in Drafter:
            for k, t, w in ((1, 0.0, 0.5), (8, 0.5, 1.0), (3, 1.0, 2.0)):
                pid = derived_id(DraftPolicy(drafter, k, t, policy_id="", controller=controller, cost_weight=w))
                assert derived_id(policy_from_id(pid)) == pid
                ids.add(pid)
    assert len(ids) == 6 * len(Controller)  # no two of these policies share an id
    for width in range(2, MAX_TREE_WIDTH + 1):
        for k, t in ((1, 0.0), (8, 0.5), (3, 1.0)):
            pid = derived_id(DraftPolicy(Drafter.MODEL, k, t, policy_id="", tree_width=width))
            assert pid.endswith(f"-tw{width}") and derived_id(policy_from_id(pid)) == pid
            assert policy_from_id(pid).tree_width == width
            ids.add(pid)
    assert len(ids) == 6 * len(Controller) + 3 * (MAX_TREE_WIDTH - 1)
    assert cell_from_text("b1-1.greedy=model-k6-t0-tw3").policy.tree_width == 3
    for text in ("b1-1.greedy=ngram-k4", "b9+.any=plain", "b2-8.sampled=moespec-model-k8-t0-w1.5"):
        cell = cell_from_text(text)
        assert f"{cell.label}={derived_id(cell.policy)}" == text
    for bad in ("b1.greedy=ngram-k4", "b1-1.fast=plain", "b1-1.any", "b1-1.any=ngram-k4-w2", "b1-1.any=k4"):
        with pytest.raises(ValueError):
            cell_from_text(bad)


def test_an_id_naming_a_tree_the_drafter_cannot_draft_parses_and_is_refused_naming_the_field():
    """The id grammar is not the validator: DraftPolicy.validate says what is wrong, as for any policy."""
    policy = policy_from_id("ngram-k4-tw2")
    assert (policy.drafter, policy.tree_width) == (Drafter.NGRAM, 2)
    with pytest.raises(InvalidRequest) as e:
        policy.validate()
    assert e.value.field == "policy.tree_width"
