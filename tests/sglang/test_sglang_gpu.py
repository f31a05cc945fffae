"""The SGLang backend on a real GPU with the shipped pair (skipped without CUDA or sglang).

    pytest -m gpu tests/sglang/test_sglang_gpu.py
One module-scoped backend: plain decoding first, then STANDALONE k=2 (one engine swap).
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra"),
]

PROMPT = "def fibonacci(n):\n    "
K2 = DraftPolicy(Drafter.MODEL, 2, policy_id="k2")


@pytest.fixture(scope="module")
def backend():
    from service.sglang_backend import add_arguments, create_backend

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", str(DEFAULT_TARGET_DIR), "--draft-model-path", str(DEFAULT_DRAFT_DIR),
                              "--speculative-algorithm", "STANDALONE", "--sglang-mem-fraction", "0.3"])
    b = create_backend(args)
    yield b
    b.close()


def greedy(max_new: int = 48) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, max_new_tokens=max_new, sampling=SamplingParams(temperature=0.0))


def test_plain_decoding_records_one_window_1_step_per_token(backend):
    result = backend.generate(greedy(), DraftPolicy(policy_id="plain"))
    info = backend.info
    assert result.spec.verify_steps == result.completion_tokens - 1
    assert all(s.window == 1 and s.unique_experts == (info.top_k,) * info.num_layers for s in result.steps)
    assert info.decode_step_seconds > 0


def test_standalone_verify_passes_count_rejected_drafts_in_the_union(backend):
    result = backend.generate(greedy(), K2)
    info = backend.info
    assert backend.info.policy_switches >= 1 and backend.info.policy_switch_seconds > 0
    assert result.spec.verify_steps >= 1
    assert result.spec.committed_tokens == result.completion_tokens - 1  # every step was found in the recorder
    for s in result.steps:
        assert s.window == 3 and s.drafted == 2
        assert all(info.top_k <= u <= min(info.num_experts, 3 * info.top_k) for u in s.unique_experts)


def test_greedy_output_matches_plain_decoding(backend):
    plain = backend.generate(greedy(), DraftPolicy(policy_id="plain"))
    spec = backend.generate(greedy(), K2)
    # bf16 verify and decode kernels may round differently; most prompts agree token for token.
    agree = sum(a == b for a, b in zip(plain.token_ids, spec.token_ids, strict=False))
    assert agree >= min(len(plain.token_ids), len(spec.token_ids)) // 2
