"""The bandwidth-share benchmark's arithmetic: the active bytes per token agree with a count taken
from the real model's parameters, and the summary pairs rounds and reports their spread."""

from __future__ import annotations

import pytest

from service.bench.bandwidth import Round, active_weight_bytes, copy_bandwidth, summarize
from service.engine.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_model


def touched_parameters(model) -> int:
    """Count from the parameters themselves: everything but the expert stacks and the embedding
    table, plus m/E of the experts, one embedding row, and the output layer once even when tied."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            total += cfg.hidden_size  # one row
        elif ".experts." in name:
            total += p.numel() * cfg.num_experts_per_tok // cfg.num_experts
        else:
            total += p.numel()
    if cfg.tie_word_embeddings:  # named_parameters lists the shared tensor once, under embed_tokens
        total += cfg.vocab_size * cfg.hidden_size
    return total


@pytest.mark.parametrize("directory", [DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["target", "draft"])
def test_active_bytes_match_the_parameters_a_step_reads(directory):
    model = load_model(directory)
    assert active_weight_bytes(model.cfg) == 4 * touched_parameters(model)
    assert active_weight_bytes(model.cfg, bytes_per_param=2) == 2 * touched_parameters(model)


def test_copy_bandwidth_is_measured_by_wall_and_cpu_time():
    wall, cpu = copy_bandwidth(megabytes=32, repeats=2)
    assert wall > 1e8 and cpu > 1e8  # bytes per second; any machine copies faster than 100 MB/s


def test_the_summary_pairs_rounds_and_reports_the_spread():
    def round_(mode, r, seconds):
        return Round(mode, r, tokens=100, seconds=seconds, cpu_seconds=seconds, step_ms_median=1.0,
                     bandwidth_gbs=10.0, bandwidth_cpu_gbs=10.0, active_bytes=10**7)

    # Round 1 is slow for both modes (a busy machine): pairing by round keeps the ratio at 2.
    results = [round_("reference", 0, 2.0), round_("fast", 0, 1.0), round_("fast", 1, 3.0),
               round_("reference", 1, 6.0)]
    summary = summarize(results, 10**7, threads=1)
    assert summary["speedup_fast_over_reference"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    fast = summary["modes"]["fast"]
    assert fast["tokens_per_second"]["min"] == pytest.approx(33.3, abs=0.1)
    assert fast["tokens_per_second"]["max"] == 100.0
    assert fast["limit_tokens_per_second"]["median"] == 1000  # 10 GB/s over 10 MB per token
    assert fast["share_of_limit"]["max"] == pytest.approx(0.1)


def test_the_default_step_is_paired_with_each_baseline_it_ran_beside():
    def round_(mode, r, seconds):
        return Round(mode, r, tokens=100, seconds=seconds, cpu_seconds=2 * seconds, step_ms_median=1.0,
                     bandwidth_gbs=10.0, bandwidth_cpu_gbs=10.0, active_bytes=10**7)

    # Rounds listed out of order (the bench rotates which step goes first): pairing is by round number.
    results = [round_("eager_attention", 1, 3.0), round_("fast", 0, 1.0), round_("eager_attention", 0, 1.5),
               round_("reference", 0, 4.0), round_("fast", 1, 2.0), round_("reference", 1, 8.0)]
    summary = summarize(results, 10**7, threads=1)
    assert summary["speedup_fast_over_eager_attention"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    assert summary["speedup_fast_over_reference"] == {"median": 4.0, "min": 4.0, "max": 4.0}
    assert summary["speedup_fast_over_reference_cpu"]["median"] == 4.0
    assert list(summary["modes"]) == ["reference", "eager_attention", "fast"]
