"""`moespec bench verify-cost`: what a verify window of w positions touching U distinct experts per
layer costs on this machine, for a real model's geometry (random weights), in ms and plain decode steps,
with a fitted cost model; writes the profile `moespec whatif --cost-profile` reads.

CPU (default): the embedded engine's fused MoE kernel (`Kernels.moe_block`) in its own panel format;
with `--context C`, the engine's whole verify pass instead (attention over C cached positions, the
embedding and the output layer, the batch and the greedy verdict: whole_pass.py), every layer of the
geometry, where the engine's model can run it.
CUDA (`--device cuda`): plain torch grouped expert products in bf16, CUDA-event timing (`--impl torch`
runs that code on the CPU too). Several layers deep (`--layers`), so that a geometry whose layers do not
fit in cache is measured from memory, as it is served."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from service.errors import UsageError

DEFAULT_WINDOWS = "1-16"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--geometry", default="target",
                        help="a preset (target, qwen3-30b-a3b, qwen2-57b-a14b, deepseek-v3, mixtral-8x7b, "
                             "olmoe-1b-7b, ling-mini-2.0) or a HuggingFace config.json path")
    parser.add_argument("--layers", type=int, default=None,
                        help="MoE layers per pass (default 4; the geometry's own with --context)")
    parser.add_argument("--windows", default=DEFAULT_WINDOWS, help="window sizes, e.g. 1-16 or 1,2,4,8 (max 16)")
    parser.add_argument("--unions", type=int, default=4, help="union values per window, spread from k to min(w k, E)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median and spread over them)")
    parser.add_argument("--repeats", type=int, default=5, help="passes per point and round (their median)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--impl", choices=("fused", "torch"), default=None,
                        help="fused: the engine's CPU kernel (cpu default); torch: grouped torch products (cuda)")
    parser.add_argument("--math", choices=("amx", "bf16", "fp32"), default=None,
                        help="the fused kernel's arithmetic (default: the engine's choice on this CPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel threads (fused; default 1, and with --context every usable core, as the engine)")
    parser.add_argument("--context", type=int, default=0,
                        help="0: the MoE blocks alone; C > 0: the engine's whole verify pass with C positions "
                             "in the cache (CPU, geometries the engine's attention runs, every layer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("reports/bench/verify-cost"),
                        help="folder for verify-cost-GEOMETRY.json / .png")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--against-engine", action="store_true",
                        help="with --geometry target: interleave each profile round with the embedded engine over "
                             "held-out prompts; compare its verify passes (windows 1-9) with the profile's prediction")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per engine round (--against-engine)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per engine request (--against-engine)")


def parse_windows(text: str) -> list[int]:
    out: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = (int(x) for x in part.split("-"))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise UsageError(f"--windows {text!r}: expected sizes like 1-16 or 1,2,4,8") from None
    if not out or min(out) < 1 or max(out) > 16:
        raise UsageError(f"--windows {text!r}: sizes must lie in 1..16")
    return sorted(out | {1})  # the plain decode step is the unit


def plan_points(g, windows: list[int], unions: int) -> list[tuple[int, int]]:
    from service.bench.verify_cost.windows import union_grid

    points = []
    for w in windows:
        points += [(w, u) for u in union_grid(w, g.top_k, g.experts, unions)]
    return points


def run(args: argparse.Namespace) -> int:
    from service.bench.verify_cost import fit, memory, presets, report
    from service.bench.verify_cost.measure import PointTiming, measure

    try:
        g = presets.resolve_geometry(args.geometry)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.threads is None:
        from service.engine.threads import usable_cores

        args.threads = usable_cores() if args.context else 1
    for name in ("rounds", "repeats", "threads", "unions"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    impl = args.impl or ("fused" if args.device == "cpu" else "torch")
    if impl == "fused" and args.device != "cpu":
        raise UsageError("--impl fused is the engine's CPU kernel: use --device cpu or --impl torch")
    windows = parse_windows(args.windows)
    if args.against_engine and (args.geometry != "target" or impl != "fused"):
        raise UsageError("--against-engine compares with the embedded engine: use --geometry target on the CPU")
    args.layers = _layers_to_bench(g, args, impl)
    try:
        available = _available_bytes(args.device)
        if args.context:
            from service.bench.verify_cost.whole_pass import whole_pass_bytes

            memory.check_bytes(g, whole_pass_bytes(g), available)
        else:
            memory.check_fits(g, args.layers, 2, False, available)  # bf16 weights
    except memory.MemoryGuardError as e:
        raise UsageError(str(e)) from None
    layers, math, timer, device_name = _build_layers(g, args, impl)
    scope = f"whole pass at context {args.context}" if args.context else "MoE blocks"
    points = plan_points(g, windows, args.unions)
    print(f"{g.name}: E={g.experts} k={g.top_k} H={g.hidden} I={g.expert_intermediate} shared={g.shared_intermediate}; "
          f"{scope}, {args.layers} layers, {impl} on {device_name} ({math}), {len(points)} (w, U) points x "
          f"{args.rounds} rounds", flush=True)
    engine = _start_engine(args, math) if args.against_engine else None
    passes: list = []
    per_round = []
    try:
        for r in range(args.rounds):  # one round of every point, then (if asked) one engine round
            per_round.append(measure(layers, points, 1, args.repeats, args.seed + r, timer))
            if engine is not None:
                from service.bench.verify_cost.against_engine import engine_round, heldout_prompts

                passes += engine_round(engine, heldout_prompts(args.prompts), args.max_new_tokens)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        layers.close()
        if engine is not None:
            engine.close()
    timings = [PointTiming(t.window, t.union, tuple(rnd[i].seconds[0] for rnd in per_round))
               for i, t in enumerate(per_round[0])]
    plain = next(t.median for t in timings if (t.window, t.union) == (1, g.top_k))
    pts = [(t.window, t.union) for t in timings]
    secs = [t.median for t in timings]
    model = fit.fit_cost_model(pts, secs)
    held = fit.held_out_error(pts, secs)
    rows = report.summary(g, model, plain)
    print(report.format_table(g, timings, plain, model, held, rows))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = (args.out / f"verify-cost-{g.name}{ext}" for ext in (".json", ".png"))  # names hold dots
    data = report.profile_json(g, args.device, impl, math, args.layers, args.threads, args.rounds, args.repeats,
                               timings, plain, model, held, rows, device_name, args.context)
    if engine is not None:
        from service.bench.verify_cost import against_engine

        compared = against_engine.compare(passes, model, g.layers / args.layers, g.top_k)
        print(f"profile ({scope}) against the engine's verify passes (median context "
              f"{against_engine.median_context(passes):.0f}), same rounds:")
        print(against_engine.format_rows(compared))
        data["against_engine"] = compared
    json_path.write_text(json.dumps(data, indent=1))
    written = [str(json_path)]
    if not args.no_plot:
        try:
            report.plot(g, timings, plain, model, png_path)
            written.append(str(png_path))
        except ImportError:
            print("matplotlib is not installed: no PNG")
    print("wrote " + " and ".join(written))
    return 0


def _layers_to_bench(g, args: argparse.Namespace, impl: str) -> int:
    """--layers, or its default: 4 MoE blocks, or with --context every layer (the whole pass)."""
    if args.context < 0:
        raise UsageError(f"--context must be >= 0, got {args.context}")
    if not args.context:
        return 4 if args.layers is None else args.layers
    if impl != "fused":
        raise UsageError("--context: the whole pass runs the embedded engine's model on the CPU (--impl fused)")
    from service.bench.verify_cost.whole_pass import whole_pass_refusal

    reason = whole_pass_refusal(g)
    if reason is not None:
        raise UsageError(f"--context: {reason}; run with --context 0 (the MoE blocks alone)")
    if args.layers not in (None, g.layers):
        raise UsageError(f"--context: the whole pass runs every layer of {g.name!r} ({g.layers}); drop --layers")
    return g.layers


def _start_engine(args: argparse.Namespace, math: str):
    from service.engine import Engine, EngineConfig

    return Engine(EngineConfig(kernel_threads=args.threads, capture_topk=True, math=math))


def _available_bytes(device: str) -> int:
    from service.bench.verify_cost import memory

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible")
        free, _ = torch.cuda.mem_get_info()
        return free
    return memory.available_bytes()


def _build_layers(g, args: argparse.Namespace, impl: str):
    from service.bench.verify_cost.measure import cpu_timer, cuda_timer

    if impl == "torch":
        from service.bench.verify_cost.torch_layers import TorchLayers

        name = _device_name(args.device)
        return TorchLayers(g, args.layers, args.device, seed=args.seed), "bf16", \
            cuda_timer if args.device == "cuda" else cpu_timer, name
    from service.bench.verify_cost.fused_cpu import WINDOW_MAX, FusedCpuLayers
    from service.bench.verify_cost.whole_pass import WholePassModel
    from service.engine.kernels import library

    if g.hidden < WINDOW_MAX:
        raise UsageError(f"geometry {g.name!r}: hidden size {g.hidden} is below {WINDOW_MAX}")
    kernels = library.build()
    if kernels is None:
        raise UsageError("the fused kernels did not build (no C compiler?): use --impl torch")
    math = args.math or kernels.default_math()
    if args.context:
        return (WholePassModel(kernels, g, math, args.threads, args.context, args.seed), math, cpu_timer,
                _device_name("cpu"))
    return FusedCpuLayers(kernels, g, args.layers, math, args.threads, args.seed), math, cpu_timer, _device_name("cpu")


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"
