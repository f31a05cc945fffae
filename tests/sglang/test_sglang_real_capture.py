"""The adapter on passes a real SGLang 0.5.23 recorded (tests/fixtures/sglang/real_cpu/, captured on
this CPU): its steps must agree with the meta_info SGLang itself returned for the same request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.engine.model.weights import MODELS_DIR
from service.sglang_backend.adapter import FinishedRequest, adapt
from service.sglang_backend.attribution import RequestTokens, attribute, leading_matches
from service.sglang_backend.model_config import moe_geometry
from service.sglang_backend.policy import effective_policy
from service.sglang_backend.records import load_dump
from service.types import Drafter, DraftPolicy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang" / "real_cpu"
GEOMETRY = moe_geometry(MODELS_DIR / "target")


def adapted(name: str):
    request = json.loads((FIXTURES / f"{name}.json").read_text())
    policy = effective_policy(DraftPolicy(Drafter(request["policy"]["drafter"]), request["policy"]["draft_length"],
                                          policy_id=request["policy"]["policy_id"]))
    done = FinishedRequest(RequestTokens(tuple(request["prompt_ids"]), tuple(request["output_ids"])),
                           request["meta_info"], decode_seconds=1.0)
    result = adapt(load_dump(FIXTURES / f"{name}.pt"), [done], policy, GEOMETRY, decode_step_seconds=0.1)[0]
    return result, request["meta_info"], policy


@pytest.mark.parametrize("name", ["model_k3", "ngram_k4", "ngram_k8"])
def test_steps_from_a_real_dump_agree_with_sglangs_meta_info(name):
    result, meta, policy = adapted(name)
    assert result.from_records  # every verify pass found, none rebuilt from the histogram
    steps = result.steps
    assert len(steps) == meta["spec_verify_ct"]
    assert sum(s.accepted for s in steps) == meta["spec_num_correct_drafts"]
    assert [sum(s.accepted == a for s in steps) for a in range(policy.draft_length + 1)] == \
        meta["spec_correct_drafts_histogram"]
    assert sum(s.committed for s in steps) == meta["completion_tokens"] - 1  # the prefill made the first
    assert all(s.window == policy.draft_length + 1 for s in steps)  # SGLang verifies k + 1 every time
    assert all(GEOMETRY.top_k <= u <= s.unique_experts_bound for s in steps for u in s.unique_experts)
    assert all(s.draft_temperature == 0.0 for s in steps)  # finding 3: never the policy's 1.0


def test_model_drafts_are_all_real():
    result, meta, _ = adapted("model_k3")
    assert sum(s.drafted for s in result.steps) == meta["spec_num_proposed_drafts"]
    assert result.spec.empty_drafts == 0


def test_ngram_filler_padding_is_verified_but_not_drafted():
    # Finding 2 (sglang-cpu-notes): every window used to count k drafts although SGLang pads short
    # matches with filler siblings: [t, 0, 0, 0, 0] at [s, s+1, s+1, s+1, s+1] drafted nothing.
    result, meta, policy = adapted("ngram_k4")
    drafted = [s.drafted for s in result.steps]
    assert drafted[:10] == [0, 0, 0, 0, 0, 0, 2, 3, 4, 0]  # as recorded: six misses, 2-, 3-, 4-token matches
    assert sum(drafted) < meta["spec_num_proposed_drafts"] == len(drafted) * policy.draft_length
    assert result.spec.empty_drafts == drafted.count(0) == 8  # and two later misses
    assert all(s.accepted <= s.drafted and len(s.accepted_per_position) == s.drafted for s in result.steps)
    assert result.spec.drafted_tokens == sum(drafted)


def test_ngram_trees_are_accepted_off_the_chain_prefix():
    # NGRAM k = 8: matches of different lengths branch off the root. This request's last window
    # accepted 3 drafts of which the chain prefix holds none (SGLang's histogram says 3); read as
    # chains it counted 0, and a window in mid-request would have lost every later window.
    request = json.loads((FIXTURES / "ngram_k8.json").read_text())
    tokens = RequestTokens(tuple(request["prompt_ids"]), tuple(request["output_ids"]))
    windows, = attribute(load_dump(FIXTURES / "ngram_k8.pt"), [tokens], speculative=True, verify_width=9,
                         moe_layers=GEOMETRY.moe_layers)
    off_chain = [w for w in windows if w.accepted > leading_matches(w.input_ids, w.positions, tokens.tokens)]
    assert off_chain and len(windows) == request["meta_info"]["spec_verify_ct"]
