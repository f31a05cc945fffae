"""The SGLang backend's step records (from passes a real SGLang 0.5.23 recorded on this CPU,
tests/fixtures/sglang/real_cpu/) carry the same per-position acceptance as the embedded engine's:
the accepted prefix, checked against a recount from the tokens (each window's drafts vs the tokens
the request's output holds there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.engine.model.weights import MODELS_DIR
from service.sglang_backend.adapter import FinishedRequest, adapt
from service.sglang_backend.attribution import RequestTokens
from service.sglang_backend.model_config import moe_geometry
from service.sglang_backend.policy import effective_policy
from service.sglang_backend.records import load_dump
from service.types import Drafter, DraftPolicy
from tests.support.acceptance_recount import committed_per_step, per_position_totals, recount

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang" / "real_cpu"
GEOMETRY = moe_geometry(MODELS_DIR / "target")


@pytest.mark.parametrize("name", ["model_k3", "ngram_k4"])
def test_sglang_per_position_acceptance_equals_the_recount_from_tokens(name):
    request = json.loads((FIXTURES / f"{name}.json").read_text())
    policy = effective_policy(DraftPolicy(Drafter(request["policy"]["drafter"]), request["policy"]["draft_length"],
                                          policy_id=request["policy"]["policy_id"]))
    output = tuple(request["output_ids"])
    done = FinishedRequest(RequestTokens(tuple(request["prompt_ids"]), output), request["meta_info"],
                           decode_seconds=1.0)
    result = adapt(load_dump(FIXTURES / f"{name}.pt"), [done], policy, GEOMETRY, decode_step_seconds=0.1,
                   capture_topk=True)[0]
    assert result.from_records  # the windows' tokens are known (not rebuilt from the histogram)
    # The prefill commits the first output token; every later one belongs to a verify step.
    committed = committed_per_step(result.steps, output, skip=1)
    recounted = []
    for step, tokens in zip(result.steps, committed, strict=True):
        drafts = list(step.window_ids[1:1 + step.drafted])  # n-gram filler after the drafts is not drafted
        expected = recount(drafts, tokens)
        assert step.accepted_per_position == expected, (step.window_ids, tokens)
        recounted.append(expected)
    assert result.spec.accepted_per_position == per_position_totals(recounted, policy.draft_length)
    assert sum(result.spec.accepted_per_position) == result.spec.accepted_tokens > 0
