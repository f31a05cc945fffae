"""Window accounting from request-span dicts: the objective and the user attributes are exact sums."""

from __future__ import annotations

import threading

import pytest

from tests.support.tuner_fixtures import request_span
from tuner.measurement.collector import SpanCollector
from tuner.measurement.spans import request_sample
from tuner.measurement.window import CostModel, Objective, WindowSpec, WindowState, WindowStats


def window_of(*spans: dict) -> WindowStats:
    w = WindowStats("s/1")
    for span in spans:
        w.add(request_sample(span))
    return w


def test_measured_cost_is_draft_plus_verify_seconds_over_committed_tokens():
    w = window_of(
        request_span("s/1", committed=10, draft_seconds=0.01, verify_seconds=0.03),
        request_span("s/1", committed=30, draft_seconds=0.02, verify_seconds=0.06),
    )
    assert w.committed == 40 and w.requests == 2
    assert w.seconds_per_token == pytest.approx((0.01 + 0.03 + 0.02 + 0.06) / 40)
    assert Objective.MEASURED.of(w, CostModel(1)) == w.seconds_per_token


def test_per_layer_unique_experts_are_step_weighted_not_a_mean_of_means():
    w = window_of(
        request_span("s/1", steps=1, unique=(10.0, 2.0)),
        request_span("s/1", steps=3, unique=(30.0, 2.0)),
    )
    assert w.unique_experts_mean == pytest.approx(((10 + 3 * 30) / 4, 2.0))
    assert w.widest_layer == 0


def test_acceptance_and_accepted_per_step():
    w = window_of(request_span("s/1", steps=10, drafted=30, accepted=12, committed=22))
    assert w.acceptance_rate == pytest.approx(12 / 30)
    assert w.mean_accepted_per_step == pytest.approx(1.2)


def test_modelled_cost_counts_unique_experts_and_fixed_bytes_per_pass():
    w = window_of(request_span("s/1", steps=2, committed=4, unique=(3.0, 1.0)))
    cost = CostModel(expert_bytes=100, fixed_bytes_per_pass=50)
    # 2 passes x (4 experts x 100 B + 50 B) / 4 tokens
    assert w.modelled_bytes_per_token(cost) == pytest.approx(2 * (400 + 50) / 4)
    assert Objective.MODELLED.of(w, cost) == w.modelled_bytes_per_token(cost)


def test_decode_step_equivalents_is_mean_verify_pass_over_decode_step():
    w = window_of(request_span("s/1", steps=4, verify_seconds=0.016))
    assert w.decode_step_equivalents(0.002) == pytest.approx(2.0)


def test_user_attrs_hold_every_figure_the_issue_asks_for():
    attrs = window_of(request_span("s/1")).user_attrs(CostModel(100), 0.002)
    for key in ("acceptance_rate", "mean_accepted_per_step", "unique_experts_mean", "widest_layer",
                "decode_step_equivalents", "modelled_bytes_per_token", "requests", "committed_tokens",
                "output_tokens", "seconds_per_token"):
        assert key in attrs


def test_empty_window_has_no_value():
    w = WindowStats("s/1")
    assert w.seconds_per_token == float("inf") and w.user_attrs(CostModel(1), 0.002)["seconds_per_token"] is None


def test_window_completes_only_with_enough_tokens_and_steps_and_starves_after_max_time():
    spec = WindowSpec(min_tokens=40, min_steps=20, max_seconds=5)
    w = window_of(request_span("s/1", steps=10, committed=40))
    assert spec.state(w, 1.0) is WindowState.OPEN  # tokens yes, steps no
    assert spec.state(w, 5.0) is WindowState.STARVED
    w.add(request_sample(request_span("s/1", steps=10, committed=40)))
    assert spec.state(w, 1.0) is WindowState.COMPLETE


def test_only_request_spans_with_a_policy_id_and_all_aggregates_are_samples():
    assert request_sample(request_span("s/1", name="verify")) is None
    no_id = request_span("")
    assert request_sample(no_id) is None
    broken = request_span("s/1")
    del broken["attributes"]["moespec.spec.committed_tokens"]
    assert request_sample(broken) is None
    assert request_sample(request_span("s/1")).policy_id == "s/1"


def test_collector_keeps_watched_policies_only_and_counts_the_rest():
    c = SpanCollector(request_sample)
    c.watch("s/1")
    c.on_spans([request_span("s/1"), request_span("other"), request_span("s/1", name="verify")])
    assert c.snapshot("s/1").requests == 1
    t = c.traffic()
    assert (t.request_spans, t.unwatched_spans) == (2, 1)


def test_collector_wait_wakes_on_new_span():
    c = SpanCollector(request_sample)
    c.watch("s/1")
    timer = threading.Timer(0.05, lambda: c.on_spans([request_span("s/1")]))
    timer.start()
    assert c.wait("s/1", after_requests=0, timeout=5).requests == 1
    assert c.wait("s/1", after_requests=1, timeout=0.01).requests == 1  # timeout, unchanged


def test_collector_refuses_spans_whose_policy_fields_disagree_with_the_watched_policy():
    from service.types import Drafter, DraftPolicy
    from tuner.measurement.spans import ran_policy

    policy = DraftPolicy(Drafter.NGRAM, 3, policy_id="s/0")
    c = SpanCollector(request_sample)
    c.watch("s/0", accept=lambda sample: ran_policy(sample, policy))
    stale = request_span("s/0")
    stale["attributes"].update({"moespec.spec.drafter": "model", "moespec.spec.draft_length": 0,
                                "moespec.spec.draft_temperature": 1.0})
    fresh = request_span("s/0")
    fresh["attributes"].update({"moespec.spec.drafter": "ngram", "moespec.spec.draft_length": 3,
                                "moespec.spec.draft_temperature": 0.3})  # ignored by n-gram
    c.on_spans([stale, fresh, request_span("s/0")])  # the last one omits the fields: accepted
    assert c.snapshot("s/0").requests == 2 and c.traffic().unwatched_spans == 1


def test_the_span_check_compares_only_the_fields_a_request_span_carries():
    """An adaptive or table trial's real spans carry the base policy's drafter, length, temperature and
    width, not its controller, cost weight or cells: they are its own spans, and a stale span of another
    length is still refused."""
    from dataclasses import replace

    from service.types import Controller, Drafter, DraftPolicy, PolicyCell, RequestKind
    from tuner.measurement.spans import ran_policy

    span = request_span("s/2")
    span["attributes"].update({"moespec.spec.drafter": "model", "moespec.spec.draft_length": 8,
                               "moespec.spec.draft_temperature": 0.0})
    sample = request_sample(span)
    adaptive = DraftPolicy(Drafter.MODEL, 8, 0.0, "s/2", controller=Controller.MOESPEC, cost_weight=1.5)
    table = DraftPolicy(Drafter.MODEL, 8, 0.0, "s/2",
                        cells=(PolicyCell(DraftPolicy(Drafter.NGRAM, 4), kind=RequestKind.GREEDY),))
    assert ran_policy(sample, adaptive) and ran_policy(sample, table)
    assert not ran_policy(sample, replace(adaptive, draft_length=6))
    assert not ran_policy(sample, replace(table, drafter=Drafter.NGRAM))
