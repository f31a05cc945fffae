"""The step limit (service/bench/limit.py): its byte count against the shipped model's own tensors,
its read probe reading exactly what it is given, and the property that makes it a limit: the
engine's measured plain decoding never runs faster than it."""

from __future__ import annotations

import pytest
import torch

from service.bench.limit import FLOAT32, decode_step_cost, fused_step_cost, measure_rates
from service.engine.kernels import probe
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_model
from service.types import DraftPolicy, GenerationRequest, SamplingParams
from tests.support.engine_helpers import heldout_prompts, make_engine


@pytest.mark.parametrize("directory", [DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["moe target", "dense draft"])
def test_the_step_bytes_are_what_one_position_reads_of_the_shipped_tensors(directory):
    """Counted from the checkpoint's tensors: every matrix a position reads (m of the E experts of
    each layer) at 2 bytes, the rest at 4; the other experts and the embedding table are not read."""
    model = load_model(directory)
    cfg = model.cfg
    E, m = cfg.num_experts, cfg.num_experts_per_tok
    matrices = small = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            small += cfg.hidden_size  # one row
        elif ".experts." in name:
            matrices += p.numel() * m // E
        elif p.dim() == 2 and "gate.weight" not in name and "shared_expert_gate" not in name:
            matrices += p.numel()
        else:  # biases, norms, router and shared-expert gate (float32 in the kernels)
            small += p.numel()
    if cfg.tie_word_embeddings:
        matrices += cfg.vocab_size * cfg.hidden_size  # the output layer reads the tied table whole
    assert decode_step_cost(cfg, 2, context=1).weight_bytes == matrices * 2 + small * FLOAT32


def test_the_read_probe_reads_every_float_it_is_given_once_per_repetition():
    probes = probe.build()
    pool = probes.pool(2)
    buf = torch.ones(128 * 1000)
    try:
        for p in (None, pool):
            assert probes.read(buf, 3, p) == 3 * buf.numel()
        assert probes.fma(5, pool) == 2 * probe.LANES * probe.FMA_CHAINS * 5 * pool.threads
    finally:
        pool.close()
    with pytest.raises(ValueError, match="float32"):
        probes.read(buf.double(), 1)


def test_plain_decoding_never_beats_the_step_limit():
    """The same-run limit over the engine's own plain decode steps (their verify seconds): a share
    above 1 would mean the limit is not one."""
    engine = make_engine()
    greedy = SamplingParams(temperature=0)
    steps = []
    for prompt in heldout_prompts(4):
        steps += engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=32, sampling=greedy),
                                 DraftPolicy()).steps
    tokens_per_second = sum(s.committed for s in steps) / sum(s.verify_seconds for s in steps)
    fastest_step = 1 / min(s.verify_seconds for s in steps)
    cost, bf16_math = fused_step_cost(engine.target, context=64)
    limit = cost.limit_tokens_per_second(measure_rates(cost.weight_bytes, engine.kernel_threads.threads), bf16_math)
    assert tokens_per_second < fastest_step < limit
