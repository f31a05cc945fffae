"""`moespec bench verify-cost`: windows with exactly the union asked (counted, and as the engine's own
kernel routes them), the config.json parsers against hand-written configs, the presets, the memory
guard, the fit recovering a known cost model, the torch path against a per-position reference, and a
tiny real run through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from service.bench.verify_cost import fit, memory, presets
from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.hf_config import ConfigError, geometry_from_config, geometry_from_config_file
from service.bench.verify_cost.profile import load_profile
from service.bench.verify_cost.windows import controlled_layers, controlled_window, union_grid

ROOT = Path(__file__).resolve().parents[2]
TINY = Geometry("tiny", hidden=32, experts=16, top_k=2, expert_intermediate=16, shared_intermediate=32, layers=3)


# ------------------------------------------------------------------------------------------- windows
def test_controlled_windows_touch_exactly_the_union_asked_with_distinct_picks_per_position() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for experts in (4, 16, 64, 128):
        for top_k in {1, 2, min(8, experts)}:
            for window in (1, 2, 3, 5, 9, 16):
                for union in range(top_k, min(window * top_k, experts) + 1):
                    ids = controlled_window(window, top_k, experts, union, g)
                    assert ids.shape == (window, top_k) and ids.dtype == torch.int64
                    assert len(set(ids.flatten().tolist())) == union
                    assert all(len(set(row)) == top_k for row in ids.tolist())
                    assert int(ids.min()) >= 0 and int(ids.max()) < experts
                    cases += 1
    assert cases > 700


def test_controlled_windows_are_drawn_not_fixed() -> None:
    g = torch.Generator().manual_seed(1)
    draws = {tuple(controlled_window(4, 8, 128, 20, g).flatten().tolist()) for _ in range(20)}
    assert len(draws) == 20
    layers = controlled_layers(3, 4, 8, 128, 20, g)
    assert layers.shape == (3, 4, 8) and not torch.equal(layers[0], layers[1])


@pytest.mark.parametrize("union", [1, 17, 100])
def test_a_union_outside_the_window_range_is_refused(union: int) -> None:
    with pytest.raises(ValueError, match=r"touches 2\.\.16 experts"):
        controlled_window(8, 2, 16, union, torch.Generator())


def test_union_grid_spans_k_to_the_bound() -> None:
    assert union_grid(4, 8, 128, 4) == [8, 16, 24, 32]
    assert union_grid(16, 8, 64, 3) == [8, 36, 64]
    assert union_grid(1, 8, 64, 4) == [8]


def test_the_engine_kernel_routes_exactly_the_steered_window() -> None:
    """The fused path's routing is steered through the router: the kernel's own returned ids are the
    window's, so the union the benchmark times is the one it asked for."""
    from service.bench.verify_cost.fused_cpu import FusedCpuLayers
    from service.bench.verify_cost.measure import check_unions
    from service.engine.kernels import library

    kernels = library.build()
    assert kernels is not None
    layers = FusedCpuLayers(kernels, TINY, 3, kernels.default_math())
    g = torch.Generator().manual_seed(2)
    for w, u in [(1, 2), (3, 5), (16, 16), (16, 2)]:
        ids = controlled_layers(3, w, 2, 16, u, g)
        layers.prepare(ids)
        routed = layers.run()
        check_unions(routed, ids)
        assert [len(set(r.flatten().tolist())) for r in routed] == [u] * 3
    with pytest.raises(RuntimeError, match="other experts"):
        check_unions(routed, controlled_layers(3, 16, 2, 16, 16, g))


# --------------------------------------------------------------------------------- the torch path
def test_torch_layers_compute_the_moe_block_a_per_position_loop_computes() -> None:
    """Grouped products over the union == for each position, its k experts one by one (float32)."""
    from service.bench.verify_cost.torch_layers import TorchLayers

    layers = TorchLayers(TINY, 2, "cpu", dtype=torch.float32)
    ids = controlled_layers(2, 5, 2, 16, 7, torch.Generator().manual_seed(3))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    layers.prepare(ids, x)
    outs = layers.run()
    for layer, layer_ids, out in zip(layers.layers, ids, outs, strict=True):
        ref = torch.zeros(5, 32)
        for p in range(5):
            for e in layer_ids[p].tolist():
                g, u = (layer["gate_up"][e] @ x[p]).chunk(2)
                ref[p] += 0.5 * (layer["down"][e] @ (F.silu(g) * u))
            sg, su = (layer["shared_gate_up"] @ x[p]).chunk(2)
            ref[p] += layer["shared_down"] @ (F.silu(sg) * su)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ parsers
CONFIGS = {
    "qwen2_moe": ({"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_experts": 60, "num_experts_per_tok": 4,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
                   "mlp_only_layers": [3], "vocab_size": 320},
                  dict(hidden=64, experts=60, top_k=4, expert_intermediate=32, shared_intermediate=128, layers=3,
                       heads=4, kv_heads=2, head_dim=16, vocab=320)),
    "qwen3_moe": ({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 32, "num_experts": 128, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 24, "decoder_sparse_step": 2, "mlp_only_layers": []},
                  dict(hidden=64, experts=128, top_k=8, expert_intermediate=24, shared_intermediate=0, layers=3,
                       heads=8, kv_heads=2, head_dim=32)),
    "deepseek_v3": ({"model_type": "deepseek_v3", "hidden_size": 112, "num_hidden_layers": 61,
                     "num_attention_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 20, "n_shared_experts": 1, "first_k_dense_replace": 3,
                     "intermediate_size": 999, "vocab_size": 1000},
                    dict(hidden=112, experts=256, top_k=8, expert_intermediate=20, shared_intermediate=20, layers=58,
                         vocab=1000)),
    "deepseek_v2": ({"model_type": "deepseek_v2", "hidden_size": 48, "num_hidden_layers": 27,
                     "num_attention_heads": 16, "n_routed_experts": 64, "num_experts_per_tok": 6,
                     "moe_intermediate_size": 14, "n_shared_experts": 2, "first_k_dense_replace": 1},
                    dict(hidden=48, experts=64, top_k=6, expert_intermediate=14, shared_intermediate=28, layers=26)),
    "mixtral": ({"model_type": "mixtral", "hidden_size": 40, "num_hidden_layers": 32, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 70},
                dict(hidden=40, experts=8, top_k=2, expert_intermediate=70, shared_intermediate=0, layers=32,
                     heads=8, kv_heads=2, head_dim=5)),
    "olmoe": ({"model_type": "olmoe", "hidden_size": 32, "num_hidden_layers": 16, "num_attention_heads": 4,
               "num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 12},
              dict(hidden=32, experts=64, top_k=8, expert_intermediate=12, shared_intermediate=0, layers=16,
                   heads=4, kv_heads=4, head_dim=8)),
    "bailing_moe_v2": ({"model_type": "bailing_moe_v2", "hidden_size": 64, "num_hidden_layers": 20,
                        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 16, "num_shared_experts": 1,
                        "first_k_dense_replace": 1},
                       dict(hidden=64, experts=256, top_k=8, expert_intermediate=16, shared_intermediate=16,
                            layers=19, heads=16, kv_heads=4, head_dim=128)),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_family_config_reads_as_its_geometry(family: str) -> None:
    config, expected = CONFIGS[family]
    assert geometry_from_config(config, "m") == Geometry("m", **expected)


def test_a_config_missing_a_key_or_of_another_family_names_it(tmp_path: Path) -> None:
    config = dict(CONFIGS["mixtral"][0])
    del config["num_local_experts"]
    with pytest.raises(ConfigError, match="mixtral config.json: missing 'num_local_experts'"):
        geometry_from_config(config)
    with pytest.raises(ConfigError, match="model_type 'llama' is not one of"):
        geometry_from_config({"model_type": "llama"})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        geometry_from_config_file(bad)


def test_presets_and_the_shipped_target() -> None:
    target = presets.resolve_geometry("target")
    shipped = json.loads((ROOT / "service/models/target/config.json").read_text())
    assert (target.experts, target.top_k, target.hidden, target.layers) == (
        shipped["num_experts"], shipped["num_experts_per_tok"], shipped["hidden_size"], shipped["num_hidden_layers"])
    q = presets.resolve_geometry("qwen3-30b-a3b")
    # The figure: a Qwen3-30B-A3B layer's experts are ~1.2 GB in bf16; the model ~30B parameters.
    assert 1.1e9 < q.experts * q.expert_params() * 2 < 1.3e9
    assert 29e9 < q.layers * q.layer_params() < 31e9
    ling = presets.resolve_geometry("ling-mini-2.0")
    assert (ling.experts, ling.top_k, ling.shared_intermediate > 0) == (256, 8, True)
    with pytest.raises(ValueError, match="not a preset"):
        presets.resolve_geometry("no-such-model")


def test_geometry_refuses_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="top_k 9 exceeds the 8 experts"):
        Geometry("x", 16, 8, 9, 4, 0, 1)
    with pytest.raises(ValueError, match="layers must be >= 1"):
        Geometry("x", 16, 8, 2, 4, 0, 0)


# ------------------------------------------------------------------------------------- memory guard
def test_memory_guard_refuses_what_does_not_fit_and_says_how_much_does() -> None:
    q = presets.PRESETS["qwen3-30b-a3b"]
    per_layer = q.layer_params() * 2
    assert memory.check_fits(q, 4, 2, False, available=int(10 * per_layer)) == 4 * per_layer
    with pytest.raises(memory.MemoryGuardError, match=r"at most 3 layer\(s\) fit"):
        memory.check_fits(q, 4, 2, False, available=int(4 * per_layer))
    with pytest.raises(memory.MemoryGuardError, match="not even one layer fits"):
        memory.check_fits(presets.PRESETS["deepseek-v3"], 1, 2, False, available=16 * 2**30)


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert memory.available_bytes(meminfo) == 2048 * 1024


# ---------------------------------------------------------------------------------------------- fit
def test_the_fit_recovers_a_known_cost_model_and_predicts_held_out_points() -> None:
    true = fit.CostModel(fixed=2e-4, per_expert=3e-5, per_position=1e-5)
    points = [(w, u) for w in range(1, 17) for u in union_grid(w, 8, 128, 4)]
    noise = torch.Generator().manual_seed(5)
    seconds = [true.seconds(w, u) * (1 + 0.002 * float(torch.randn(1, generator=noise))) for w, u in points]
    got = fit.fit_cost_model(points, seconds)
    assert got.fixed == pytest.approx(true.fixed, rel=0.05)
    assert got.per_expert == pytest.approx(true.per_expert, rel=0.02)
    assert got.per_position == pytest.approx(true.per_position, rel=0.05)
    held = fit.held_out_error(points, seconds)
    assert len(held.points) == len(points) // 4 and held.max_abs < 0.01


def test_the_fit_with_the_cross_term_recovers_it_and_refuses_points_that_do_not_separate() -> None:
    true = fit.CostModel(1e-4, 2e-5, 5e-6, 1e-7)
    points = [(w, u) for w in (1, 2, 4, 8) for u in union_grid(w, 2, 16, 3)]
    got = fit.fit_cost_model(points, [true.seconds(*p) for p in points], cross=True)
    assert got.per_expert_position == pytest.approx(true.per_expert_position, rel=1e-6)
    with pytest.raises(ValueError, match="do not separate"):
        fit.fit_cost_model([(w, 2 * w) for w in range(1, 6)], [1.0] * 5)


# ---------------------------------------------------------------------------------------- end to end
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "bench", "verify-cost", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("impl", ["fused", "torch"])
def test_a_tiny_real_run_through_the_command_line_writes_a_profile(tmp_path: Path, impl: str) -> None:
    config = tmp_path / "tiny-2.0" / "config.json"  # the geometry is named after the folder, dots and all
    config.parent.mkdir()
    config.write_text(json.dumps(dict(CONFIGS["qwen2_moe"][0], mlp_only_layers=[])))
    done = run_cli("--geometry", str(config), "--layers", "2", "--windows", "1,2,4,8", "--unions", "3",
                   "--rounds", "2", "--repeats", "2", "--impl", impl, "--out", str(tmp_path), "--no-plot")
    assert done.returncode == 0, done.stderr
    assert "held-out" in done.stdout and "plain decode steps" in done.stdout
    data = json.loads((tmp_path / "verify-cost-tiny-2.0.json").read_text())
    assert {(p["window"], p["union"]) for p in data["points"]} == {
        (1, 4), (2, 4), (2, 6), (2, 8), (4, 4), (4, 10), (4, 16), (8, 4), (8, 18), (8, 32)}
    assert all(len(p["seconds"]) == 2 and p["seconds_median"] > 0 for p in data["points"])
    plain = next(p for p in data["points"] if (p["window"], p["union"]) == (1, 4))
    assert plain["plain_steps"] == 1.0 and data["impl"] == impl
    profile = load_profile(tmp_path / "verify-cost-tiny-2.0.json")
    assert profile.layers_benched == 2 and profile.geometry.experts == 60


def test_bad_arguments_are_refused_with_the_reason(tmp_path: Path) -> None:
    """In-process (the command line's start-up is seconds): each refusal is a UsageError (exit 2)."""
    import argparse

    from service.bench.verify_cost import command
    from service.errors import UsageError

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for argv, reason in [(["--geometry", "deepseek-v3", "--layers", "64"], "GiB of weights"),
                         (["--windows", "0-20"], "--windows"), (["--geometry", "nope"], "not a preset"),
                         (["--rounds", "0"], "--rounds must be >= 1"), (["--context", "-1"], "--context must be >= 0")]:
        with pytest.raises(UsageError, match=reason):
            command.run(parser.parse_args([*argv, "--out", str(tmp_path)]))
    assert not list(tmp_path.iterdir())  # refused before measuring or writing anything


def test_against_engine_compares_each_window_at_its_own_unions_in_seconds_and_plain_steps() -> None:
    from service.bench.verify_cost.against_engine import compare, median_context

    model = fit.CostModel(fixed=1e-4, per_expert=1e-5, per_position=2e-5)
    # The engine's passes cost 1.25x the profile's prediction at their own unions (4 layers, benched 2).
    passes = [(1, 8.0, 1.25 * 2 * model.seconds(1, 8), 40), (1, 8.0, 1.25 * 2 * model.seconds(1, 8), 41),
              (3, 20.0, 1.25 * 2 * model.seconds(3, 20), 42), (3, 12.0, 1.25 * 2 * model.seconds(3, 12), 45),
              (12, 30.0, 1.0, 48)]  # past window 9: not compared
    rows = compare(passes, model, scale=2.0, top_k=8)
    assert median_context(passes) == 42
    assert [r["window"] for r in rows] == [1, 3]
    assert all(r["error"] == pytest.approx(-0.2) for r in rows)
    assert all(r["error_in_plain_steps"] == pytest.approx(0.0, abs=1e-12) for r in rows)
    assert rows[1]["passes"] == 2


def test_amx_arithmetic_takes_the_tiles_only_where_every_input_size_is_a_multiple_of_32():
    """As the engine's panel_format does per call: a geometry with a 16-wide expert falls back to bf16
    arithmetic (the tiles would read past each panel), a real one takes the tiles."""
    from service.bench.verify_cost.fused_cpu import panel_format_for
    from service.engine.kernels.packed import BF16_AMX, BF16_MATH

    assert panel_format_for("amx", TINY) == BF16_MATH
    assert panel_format_for("amx", presets.PRESETS["qwen3-30b-a3b"]) == BF16_AMX
    assert panel_format_for("bf16", presets.PRESETS["qwen3-30b-a3b"]) == BF16_MATH
