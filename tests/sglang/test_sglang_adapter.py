"""Recorder passes + meta_info -> the same StepRecords and SpecStats the embedded engine reports."""

from __future__ import annotations

import dataclasses

import pytest

from service.sglang_backend.adapter import adapt
from service.sglang_backend.records import dump_files, load_dump
from service.types import Drafter, DraftPolicy
from tests.fixtures.sglang.scenario import load

SPEC_POLICY = DraftPolicy(Drafter.MODEL, draft_length=3, draft_temperature=0.0, policy_id="k3")
PLAIN_POLICY = DraftPolicy(policy_id="plain")


def passes_of(name: str):
    return load_dump(dump_files(load(name).folder)[0])


def check_steps(steps, expected, geometry, k):
    assert len(steps) == len(expected)
    for got, want in zip(steps, expected, strict=True):
        assert (got.accepted, got.committed, got.window) == (want["accepted"], want["committed"], want["window"])
        assert got.unique_experts == tuple(want["unique_experts"])
        assert got.drafted == k
        assert got.accepted_per_position == tuple(i < want["accepted"] for i in range(k))
        assert got.unique_experts_bound == min(geometry.num_experts, want["window"] * geometry.top_k)


def test_each_verify_pass_becomes_one_step_per_request_with_rejected_drafts_in_the_union():
    s = load("speculative")
    a, b = adapt(passes_of("speculative"), [s.finished("A"), s.finished("B")], SPEC_POLICY, s.geometry,
                 decode_step_seconds=0.01)
    for name, got in (("A", a), ("B", b)):
        assert got.from_records
        check_steps(got.steps, s.expected[name]["steps"], s.geometry, 3)
    # A's second pass accepted nothing, yet its union spans all 4 positions (> one token's 8).
    assert a.steps[1].accepted == 0 and min(a.steps[1].unique_experts) > 8


def test_request_order_does_not_change_the_attribution():
    s = load("speculative")
    passes = passes_of("speculative")
    ab = adapt(passes, [s.finished("A"), s.finished("B")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    ba = adapt(passes, [s.finished("B"), s.finished("A")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    assert ab[0].steps == ba[1].steps and ab[1].steps == ba[0].steps


def test_a_request_alone_finds_its_steps_among_other_requests_passes():
    s = load("speculative")
    [b] = adapt(passes_of("speculative"), [s.finished("B")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    check_steps(b.steps, s.expected["B"]["steps"], s.geometry, 3)


def test_stats_agree_with_sglang_meta_info():
    s = load("speculative")
    a, b = adapt(passes_of("speculative"), [s.finished("A"), s.finished("B")], SPEC_POLICY, s.geometry,
                 decode_step_seconds=0.01)
    for name, got in (("A", a), ("B", b)):
        meta = s.meta[name]
        assert got.spec.verify_steps == meta["spec_verify_ct"]
        assert got.spec.drafted_tokens == meta["spec_num_proposed_drafts"]
        # Every output token after the prefill's came from a verify pass.
        assert got.spec.committed_tokens == meta["completion_tokens"] - 1
    # A ran to the end of its last window: its accepted drafts are exactly SGLang's count.
    assert a.spec.accepted_tokens == s.meta["A"]["spec_num_correct_drafts"]
    assert a.spec.accepted_per_position == (2, 2, 1)
    # B's last pass accepted 2 drafts but max_new_tokens kept 1: the steps count what reached the output.
    assert b.spec.accepted_tokens == s.meta["B"]["spec_num_correct_drafts"] - 1
    assert b.spec.drafter is Drafter.MODEL and b.spec.draft_length == 3 and b.spec.policy_id == "k3"


def test_time_is_shared_evenly_over_the_steps():
    s = load("speculative")
    [a] = adapt(passes_of("speculative"), [s.finished("A", decode_seconds=0.3)], SPEC_POLICY, s.geometry,
                decode_step_seconds=0.05)
    assert [st.verify_seconds for st in a.steps] == pytest.approx([0.1] * 3)
    assert [st.decode_step_equivalents for st in a.steps] == pytest.approx([2.0] * 3)
    assert a.spec.draft_seconds == 0.0 and a.spec.verify_seconds == pytest.approx(0.3)


def test_plain_decoding_is_one_window_1_step_per_token_and_skips_the_extra_overlap_pass():
    s = load("plain")
    c, d = adapt(passes_of("plain"), [s.finished("C"), s.finished("D")], PLAIN_POLICY, s.geometry,
                 decode_step_seconds=0.01)
    for name, got in (("C", c), ("D", d)):
        assert got.from_records
        check_steps(got.steps, s.expected[name]["steps"], s.geometry, 0)
        assert len(got.spec.unique_experts_mean) == 2  # the MoE layers only (layer 0 is dense)
    # C's second step ran inside the MIXED pass next to D's prefill.
    assert len(c.steps) == 4 and c.spec.committed_tokens == 4
    assert c.steps[0].decode_step_equivalents == pytest.approx(0.1 / 4 / 0.01)


def test_without_records_counts_come_from_meta_info_and_unions_are_zero():
    s = load("speculative")
    [a] = adapt([], [s.finished("A")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    assert not a.from_records
    assert a.spec.verify_steps == 3 and a.spec.accepted_tokens == 5 and a.spec.accepted_per_position == (2, 2, 1)
    assert a.spec.unique_experts_max == (0, 0, 0, 0)


def test_plain_without_records_counts_one_step_per_token_after_the_first():
    s = load("plain")
    [c] = adapt([], [s.finished("C")], PLAIN_POLICY, s.geometry, decode_step_seconds=0.01)
    assert c.spec.verify_steps == 4 and c.spec.committed_tokens == 4 and c.spec.drafted_tokens == 0


def test_captured_topk_is_L_w_m_over_the_moe_layers():
    s = load("plain")
    [c] = adapt(passes_of("plain"), [s.finished("C")], PLAIN_POLICY, s.geometry, decode_step_seconds=0.01,
                capture_topk=True)
    topk = c.steps[0].topk_ids
    assert len(topk) == 2 and len(topk[0]) == 1 and len(topk[0][0]) == 4
    assert c.steps[0].window_ids == (s.expected["C"]["output_ids"][0],)


def test_passes_under_another_window_width_are_not_misread():
    s = load("speculative")
    wrong = dataclasses.replace(SPEC_POLICY, draft_length=2)  # width 3 does not divide 8-token passes
    [a] = adapt(passes_of("speculative"), [s.finished("A")], wrong, s.geometry, decode_step_seconds=0.01)
    assert not a.from_records and a.spec.verify_steps == 3


def test_a_second_rank_copy_of_the_same_passes_is_not_counted_twice():
    # Under TP without EP every rank dumps as EP rank 0: the backend may read two copies.
    s = load("speculative")
    passes = passes_of("speculative")
    twice = passes + [dataclasses.replace(p, index=p.index + len(passes)) for p in passes]
    once = adapt(passes, [s.finished("A"), s.finished("B")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    both = adapt(twice, [s.finished("A"), s.finished("B")], SPEC_POLICY, s.geometry, decode_step_seconds=0.01)
    assert [r.steps for r in once] == [r.steps for r in both]
