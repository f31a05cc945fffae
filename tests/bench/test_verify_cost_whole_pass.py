"""`moespec bench verify-cost --context C`: the engine's whole verify pass with steered routing. The
routing the engine's own kernels return is the window's at every layer (through attention and the
residual stream), the context sits in the cache and the window lands after it, geometries the engine's
attention cannot run are refused with the reason, and a tiny real run through the command line writes
a whole-pass profile that the what-if reads as one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.bench.verify_cost import presets
from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.measure import check_unions
from service.bench.verify_cost.profile import WHOLE_PASS, load_profile
from service.bench.verify_cost.whole_pass import WholePassModel, whole_pass_refusal
from service.bench.verify_cost.windows import controlled_layers

ROOT = Path(__file__).resolve().parents[2]
# hidden 64 = 4 heads of 16; every input size a multiple of 32, so the AMX tiles take them where the CPU has them
SMALL = Geometry("small", hidden=64, experts=24, top_k=3, expert_intermediate=32, shared_intermediate=64, layers=3,
                 heads=4, kv_heads=2, head_dim=16, vocab=96)


@pytest.fixture(scope="module")
def kernels():
    from service.engine.kernels import library

    built = library.build()
    assert built is not None
    return built


@pytest.mark.parametrize("math", ["fp32", "default"])
def test_the_whole_pass_routes_exactly_the_steered_window_at_every_layer(kernels, math: str) -> None:
    """The kernels' own routed ids, after attention and the residual adds of earlier layers, are the
    window's: the union the profile times is the one it asked for."""
    model = WholePassModel(kernels, SMALL, kernels.default_math() if math == "default" else math, 1, context=7)
    g = torch.Generator().manual_seed(3)
    try:
        for w, u in [(1, 3), (2, 4), (4, 12), (9, 3), (16, 24), (16, 10)]:
            ids = controlled_layers(SMALL.layers, w, SMALL.top_k, SMALL.experts, u, g)
            model.prepare(ids)
            for _ in range(2):  # a repeat overwrites the same rows and routes alike
                with torch.inference_mode():
                    routed = model.run()
                check_unions(routed, ids)
            assert [len(set(r.flatten().tolist())) for r in routed] == [u] * SMALL.layers
    finally:
        model.close()


def test_nothing_writes_into_the_steering_columns_of_the_residual_stream(kernels) -> None:
    """What makes the steering exact rather than likely: after every layer, the first WINDOW_MAX columns
    of each position's residual stream are still its embedding's (e_p), bit for bit."""
    from service.bench.verify_cost.fused_cpu import WINDOW_MAX
    from service.engine.model.ragged import RaggedBatch

    model = WholePassModel(kernels, SMALL, "fp32", 1, context=5)
    try:
        model.prepare(controlled_layers(SMALL.layers, 6, SMALL.top_k, SMALL.experts, 9, torch.Generator()))
        batch = RaggedBatch.build([0], [5], [6], tokens=list(range(6)))
        with torch.inference_mode():
            out = model.model.forward_ragged(batch.tokens, batch, model.cache, capture=tuple(range(SMALL.layers)))
        per_layer = out.aux.view(6, SMALL.layers, SMALL.hidden)[:, :, :WINDOW_MAX]
        assert torch.equal(per_layer, torch.eye(WINDOW_MAX)[:6, None, :].expand(6, SMALL.layers, WINDOW_MAX))
    finally:
        model.close()


def test_the_context_is_in_the_cache_and_the_window_is_written_after_it(kernels) -> None:
    model = WholePassModel(kernels, SMALL, "fp32", 1, context=11)
    try:
        keys = model.cache.k[:, 0]  # [L, K, S, D]
        assert bool((keys[:, :, :11].abs().sum(-1) > 0).all())  # every layer's context rows written
        assert not bool(keys[:, :, 11:].any())
        model.prepare(controlled_layers(SMALL.layers, 4, SMALL.top_k, SMALL.experts, 6, torch.Generator()))
        with torch.inference_mode():
            model.run()
        assert bool((keys[:, :, 11:15].abs().sum(-1) > 0).all()) and not bool(keys[:, :, 15:].any())
    finally:
        model.close()


def test_geometries_whose_attention_the_engine_does_not_run_are_refused_with_the_reason() -> None:
    assert whole_pass_refusal(SMALL) is None
    assert whole_pass_refusal(presets.resolve_geometry("target")) is None
    assert "no attention part" in whole_pass_refusal(presets.PRESETS["deepseek-v3"])
    assert "is not the hidden size 2048" in whole_pass_refusal(presets.PRESETS["qwen3-30b-a3b"])
    no_vocab = Geometry("v", 64, 8, 2, 32, 0, 2, heads=4, kv_heads=2, head_dim=16)
    assert "vocab_size" in whole_pass_refusal(no_vocab)


def test_bad_whole_pass_arguments_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    import argparse

    from service.bench.verify_cost import command
    from service.errors import UsageError

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for argv, reason in [(["--geometry", "qwen3-30b-a3b", "--context", "64"], "head dim = hidden / heads"),
                         (["--geometry", "deepseek-v3", "--context", "64"], "no attention part"),
                         (["--context", "64", "--layers", "2"], "every layer of 'target'"),
                         (["--context", "64", "--impl", "torch"], "--impl fused"),
                         (["--geometry", "qwen2-57b-a14b", "--context", "64"], "whole model needs")]:
        with pytest.raises(UsageError, match=reason):
            command.run(parser.parse_args([*argv, "--out", str(tmp_path)]))
    assert not list(tmp_path.iterdir())


def test_a_tiny_whole_pass_run_through_the_command_line_writes_a_whole_pass_profile(tmp_path: Path) -> None:
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 20,
                                  "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                                  "shared_expert_intermediate_size": 64, "vocab_size": 200}))
    done = subprocess.run([sys.executable, "-m", "service.cli", "bench", "verify-cost", "--geometry", str(config),
                           "--context", "24", "--windows", "1,3,6", "--unions", "2", "--rounds", "2", "--repeats", "2",
                           "--out", str(tmp_path), "--no-plot"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "whole pass at context 24, 2 layers" in done.stdout
    data = json.loads((tmp_path / "verify-cost-tiny.json").read_text())
    assert (data["scope"], data["context"], data["layers_benched"]) == (WHOLE_PASS, 24, 2)
    assert {(p["window"], p["union"]) for p in data["points"]} == {(1, 4), (3, 4), (3, 12), (6, 4), (6, 20)}
    profile = load_profile(tmp_path / "verify-cost-tiny.json")
    assert (profile.scope, profile.context) == (WHOLE_PASS, 24)
    assert profile.describe_scope() == "the whole pass at context 24"
    # the full model was benched: a pass over the geometry's layers is the fitted pass itself
    assert profile.pass_seconds(3, 8) == pytest.approx(profile.model.seconds(3, 8))
