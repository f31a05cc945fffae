"""`moespec bench sglang-batching`: how much of SGLang's own batching gain the SGLang backend keeps.

    ~/.cache/moespec/sglang-venv/bin/moespec bench sglang-batching [--clients 8 16] [--rounds 3] [--bursts 1]
        [--max-new-tokens 32] [--device cpu|cuda] [--out docs/benchmarks/sglang-batching]

Run it with the moespec of an environment that has sglang (scripts/setup_sglang_cpu.sh builds one).
Plain greedy decoding of the shipped target (fp32 on CPU) on the first max(--clients) held-out
prompts. Each round runs three contenders, one engine at a time, in an order that alternates between
rounds so drift on a shared machine hits all alike:
- `alone`: a bare `sglang.Engine` with the backend's own engine arguments (service/bench/sglang_alone.py):
  the prompts one after another, then one batch call of the first C prompts for each C of --clients;
- `moespec`: `moespec serve --backend sglang` at its defaults (routing statistics on) over gRPC: one
  client sending the prompts one after another, then C client threads sending one prompt each (--bursts
  times, timed together);
- `moespec-no-stats`: the same with `--sglang-no-expert-record`.
Reported per round and as median [min, max] over rounds: tokens/s of each; each contender's gain at C
clients over its own one-at-a-time tokens/s; moespec's gain as a share of SGLang alone's; and statistics
on vs off at C clients. JSON and a Markdown table land in --out (the table is printed).

On --device cpu the children need sgl-kernel's CPU ops: the test-support stand-ins (tests/sglang_cpu/site,
--stand-in) go on the children's PYTHONPATH only. Figures taken that way are "CPU with stand-in kernels".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from service.bench.sglang import MODELS, STAND_IN
from service.types import GenerationRequest, SamplingParams

TOKEN = "bench-sglang-batching"
CONTENDERS = ("alone", "moespec", "moespec-no-stats")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 16], help="concurrent clients to measure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=1,
                        help="times each server sends its C concurrent prompts, timed together (more work per "
                             "figure: the statistics on/off ratio compares two servers)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--stand-in", type=Path, default=STAND_IN,
                        help="directory put on the children's PYTHONPATH on --device cpu (sgl-kernel CPU ops)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-sglang-batching"))


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from service.errors import UsageError

    if min(args.rounds, args.bursts, args.max_new_tokens) < 1 or min(args.clients) < 2:
        raise UsageError("--rounds, --bursts and --max-new-tokens must be >= 1, every --clients >= 2")
    if importlib.util.find_spec("sglang") is None:
        raise UsageError("bench sglang-batching needs sglang in this environment: run the moespec of the SGLang "
                         "venv (bash scripts/setup_sglang_cpu.sh builds ~/.cache/moespec/sglang-venv)")
    from service.bench.engine import load_prompts

    prompts = load_prompts(max(args.clients))
    rounds = []
    for r in range(args.rounds):
        order = CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))
        figures = {name: measure(name, prompts, args) for name in order}
        rounds.append({"order": list(order), **figures})
        print(f"round {r + 1}: {json.dumps(summary_of_round(figures, args.clients))}", file=sys.stderr, flush=True)
    result = {"device": args.device, "cpu": cpu_name(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "clients": args.clients, "bursts": args.bursts, "rounds": rounds,
              "summary": summarise(rounds, args.clients)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sglang_batching.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "sglang_batching.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/sglang_batching.json, .md")
    return 0


def child_env(args: argparse.Namespace) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": os.pathsep.join([str(args.stand_in), repo])} if args.device == "cpu" else {}


def serve_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--model-path", str(MODELS / "target")]
    return flags + (["--sglang-arg", "dtype=float32"] if args.device == "cpu" else [])


def measure(name: str, prompts: list[str], args: argparse.Namespace) -> dict:
    """tokens/s one at a time ("1") and at each client count, for one contender."""
    if name == "alone":
        return measure_alone(prompts, args)
    return measure_server(prompts, args, stats=name == "moespec")


def measure_alone(prompts: list[str], args: argparse.Namespace) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps([tokenizer.encode(p).ids for p in prompts]))
        done = subprocess.run([sys.executable, "-m", "service.bench.sglang_alone", "--prompts", str(path),
                               "--max-new-tokens", str(args.max_new_tokens), "--batch-sizes",
                               *map(str, args.clients), *serve_flags(args)],
                              env={**os.environ, **child_env(args)}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"sglang_alone failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])["rounds"][0]
    out = {"1": sum(map(len, figures["sequential"])) / figures["sequential_s"]}
    for size, batch in figures["batch_sizes"].items():
        out[size] = batch["tokens"] / batch["seconds"]
    return out


def measure_server(prompts: list[str], args: argparse.Namespace, stats: bool) -> dict:
    from service.server.client import MoespecClient
    from tuner.drivers.server_proc import start_server

    flags = ["--backend", "sglang", *serve_flags(args), *([] if stats else ["--sglang-no-expert-record"])]
    server = start_server(child_env(args), TOKEN, tuple(flags), ready_timeout=900)
    greedy = SamplingParams(temperature=0.0)
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=120)

            def one(prompt: str) -> int:
                request = GenerationRequest(prompt=prompt, max_new_tokens=args.max_new_tokens, sampling=greedy)
                return client.generate(request, timeout=900).completion_tokens

            # One at a time first, on both servers alike: it is the moespec side's baseline, and it warms
            # the engine (allocator, first passes) before the concurrent phases are timed.
            t0 = time.perf_counter()
            tokens = sum(one(p) for p in prompts)
            out = {"1": tokens / (time.perf_counter() - t0)}
            for clients in args.clients:
                with ThreadPoolExecutor(clients) as pool:
                    tokens, seconds = 0, 0.0
                    for _ in range(args.bursts):
                        t0 = time.perf_counter()
                        tokens += sum(pool.map(one, prompts[:clients]))
                        seconds += time.perf_counter() - t0
                    out[str(clients)] = tokens / seconds
    finally:
        server.stop(timeout=120)
    return out


def summary_of_round(figures: dict, clients: list[int]) -> dict:
    alone, moespec, bare = figures["alone"], figures["moespec"], figures["moespec-no-stats"]
    out = {}
    for c in map(str, clients):
        gain_alone, gain_moespec = alone[c] / alone["1"], moespec[c] / moespec["1"]
        out[c] = {"alone_gain": gain_alone, "moespec_gain": gain_moespec, "share_of_gain": gain_moespec / gain_alone,
                  "stats_on_vs_off": moespec[c] / bare[c]}
    return out


def summarise(rounds: list[dict], clients: list[int]) -> dict:
    per_round = [summary_of_round(r, clients) for r in rounds]
    out = {}
    for c in map(str, clients):
        out[c] = {}
        for key in per_round[0][c]:
            values = [r[c][key] for r in per_round]
            out[c][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for name in CONTENDERS:
            values = [r[name][c] for r in rounds]
            out[c][f"{name}_tokens_per_s"] = {"median": statistics.median(values), "min": min(values),
                                              "max": max(values)}
    out["one_at_a_time_tokens_per_s"] = {name: statistics.median(r[name]["1"] for r in rounds)
                                         for name in ("alone", "moespec")}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]

    def cell(figure: dict, unit: str = "x") -> str:
        return f"{figure['median']:.2f}{unit} [{figure['min']:.2f}, {figure['max']:.2f}]"

    lines = [f"SGLang backend batching, plain greedy, {result['prompts']} held-out prompts x "
             f"{result['max_new_tokens']} tokens, {len(result['rounds'])} rounds, {result.get('bursts', 1)} burst(s) "
             f"per server, device {result['device']} "
             f"({result['cpu']}); median [min, max] over rounds", "",
             f"one at a time: SGLang alone {s['one_at_a_time_tokens_per_s']['alone']:.1f} tok/s, through moespec "
             f"{s['one_at_a_time_tokens_per_s']['moespec']:.1f} tok/s", "",
             "| clients | SGLang alone tok/s | moespec tok/s | SGLang alone's gain | moespec's gain | "
             "share of SGLang's gain | statistics on / off |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in map(str, result["clients"]):
        row = s[c]
        lines.append(f"| {c} | {cell(row['alone_tokens_per_s'], '')} | {cell(row['moespec_tokens_per_s'], '')} | "
                     f"{cell(row['alone_gain'])} | {cell(row['moespec_gain'])} | {cell(row['share_of_gain'])} | "
                     f"{cell(row['stats_on_vs_off'])} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
