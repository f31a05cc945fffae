"""`moespec bench sglang-trees`: EAGLE-3 draft trees against chains on the SGLang backend.

    ~/.cache/moespec/sglang-venv/bin/moespec bench sglang-trees [--lengths 2 4 6] [--widths 2 3]
                         [--prompts 8] [--rounds 2] [--max-new-tokens 32] [--tree-temperature auto]
                         [--out reports/bench-sglang-trees]

One `moespec serve --backend sglang --speculative-algorithm EAGLE3` child (the shipped pair and EAGLE-3
draft, fp32 on CPU; beyond the defaults only --sglang-no-ngram, --sglang-no-calibrate and --otel-disabled,
the same for every policy) is served through gRPC. For every draft length k, the chain (tree width 1) and a
tree of each width w run the same greedy requests (k nodes verified per pass either way); each policy is
set through PolicyAdmin and its first request absorbs the engine swap. The policies' order reverses
from round to round, so machine drift hits chains and trees alike. Reported per policy, median and
min-max over the rounds: accepted drafts per verify pass, the whole window's distinct routed experts
per layer (the tree's union), the mean branch's (what one root-to-leaf chain of the tree touched),
and tokens/s (client wall time). The question it answers is the reference's: a wider tree is accepted
more, and touches more experts, at an equal verify budget. JSON and a Markdown table land in --out.

On --device cpu the child needs sgl-kernel's CPU ops: the stand-ins (tests/sglang_cpu/site) go on its
PYTHONPATH only. Timings taken that way are "CPU with stand-in kernels", not SGLang's real CPU speed;
acceptance and expert counts do not depend on them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from service.bench.sglang_batching import child_env, cpu_name, serve_flags
from service.types import MAX_TREE_WIDTH, Drafter, DraftPolicy, GenerationRequest, SamplingParams

STAND_IN = Path(__file__).resolve().parents[2] / "tests" / "sglang_cpu" / "site"
TOKEN = "bench-sglang-trees"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 4, 6], help="draft lengths k (node budgets)")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 3], help="tree widths beside the chain")
    parser.add_argument("--prompts", type=int, default=8, help="shipped held-out prompts per policy and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tree-temperature", default="auto", metavar="TAU",
                        help="the server's --sglang-tree-temperature (default auto, the server's: the shipped "
                             "draft's recorded 0.15; 1: SGLang's own ranking)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--stand-in", type=Path, default=STAND_IN,
                        help="directory put on the child's PYTHONPATH on --device cpu (sgl-kernel CPU ops)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-sglang-trees"))


def policies(args: argparse.Namespace) -> list[DraftPolicy]:
    return [DraftPolicy(Drafter.MODEL, k, 0.0, policy_id=f"k{k}-w{w}", tree_width=w)
            for k in args.lengths for w in (1, *args.widths)]


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from service.errors import UsageError

    if min(args.prompts, args.rounds, args.max_new_tokens) < 1 or min(args.lengths) < 2:
        raise UsageError("--prompts, --rounds and --max-new-tokens must be >= 1, --lengths >= 2 (one node is a chain)")
    if not all(2 <= w <= MAX_TREE_WIDTH for w in args.widths):
        raise UsageError(f"--widths must lie in [2, {MAX_TREE_WIDTH}] (1, the chain, always runs)")
    if importlib.util.find_spec("sglang") is None:
        raise UsageError("bench sglang-trees needs sglang in this environment: run the moespec of the SGLang "
                         "venv (bash scripts/setup_sglang_cpu.sh builds ~/.cache/moespec/sglang-venv)")
    runs = measure(args)
    rows = [summary(policy, runs[policy.policy_id]) for policy in policies(args)]
    result = {"device": args.device, "cpu": cpu_name(), "tree_temperature": args.tree_temperature,
              "prompts": args.prompts, "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sglang_trees.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "sglang_trees.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/sglang_trees.json, .md")
    return 0


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    """{policy id: one figure dict per round}."""
    from service.bench.engine import load_prompts
    from service.server.client import MoespecClient
    from tuner.drivers.server_proc import start_server

    prompts = load_prompts(args.prompts)
    first = policies(args)[0]
    flags = ("--backend", "sglang", *serve_flags(args), "--speculative-algorithm", "EAGLE3", "--sglang-no-ngram",
             "--sglang-no-calibrate", "--otel-disabled", "--drafter", "model",
             "--draft-length", str(first.draft_length), "--sglang-tree-temperature", str(args.tree_temperature))
    server = start_server(child_env(args), TOKEN, flags, ready_timeout=900)
    runs: dict[str, list[dict]] = {p.policy_id: [] for p in policies(args)}
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=120)
            for r in range(args.rounds):
                order = policies(args) if r % 2 == 0 else policies(args)[::-1]
                for policy in order:
                    runs[policy.policy_id].append(run_policy(client, policy, prompts, args.max_new_tokens))
                print(f"round {r + 1}: done", file=sys.stderr, flush=True)
    finally:
        server.stop(timeout=120)
    return runs


def run_policy(client, policy: DraftPolicy, prompts: list[str], max_new: int) -> dict:
    greedy = SamplingParams(temperature=0.0)
    client.set_policy(policy)
    client.generate(GenerationRequest(prompt=prompts[0], max_new_tokens=4, sampling=greedy), timeout=900)  # swap
    steps = accepted = tokens = 0
    tree_unions, branch_unions = [], []  # per request: mean over layers, weighted by its verify passes
    t0 = time.perf_counter()
    for prompt in prompts:
        reply = client.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=greedy), timeout=900)
        spec = reply.spec
        steps, accepted = steps + spec.verify_steps, accepted + spec.accepted_tokens
        tokens += reply.completion_tokens
        tree_unions += [statistics.fmean(spec.unique_experts_mean)] * spec.verify_steps
        branch = spec.branch_unique_experts_mean or spec.unique_experts_mean  # () where no step was a tree
        branch_unions += [statistics.fmean(branch)] * spec.verify_steps
    seconds = time.perf_counter() - t0
    return {"accepted_per_pass": accepted / max(1, steps), "tree_union": statistics.fmean(tree_unions),
            "branch_union": statistics.fmean(branch_unions), "tokens_per_s": tokens / seconds}


def summary(policy: DraftPolicy, rounds: list[dict]) -> dict:
    out = {"policy": policy.policy_id, "draft_length": policy.draft_length, "tree_width": policy.tree_width}
    for key in ("accepted_per_pass", "tree_union", "branch_union", "tokens_per_s"):
        values = [r[key] for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def markdown(result: dict) -> str:
    label = "CPU with stand-in kernels" if result["device"] == "cpu" else "CUDA"
    ranking = {"1": "SGLang's own tree ranking", "auto": "trees ranked at the draft's recorded temperature"}.get(
        str(result["tree_temperature"]), f"trees ranked at temperature {result['tree_temperature']}")
    lines = [f"SGLang EAGLE-3 chains and trees ({label}, {result['cpu']}), {ranking}, greedy, {result['prompts']} "
             f"prompts x {result['rounds']} rounds, {result['max_new_tokens']} new tokens; "
             "median [min-max] over rounds",
             "",
             "| k | tree width | accepted drafts / pass | distinct experts / layer (window) | "
             "(mean branch) | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|"]

    def cell(figure: dict, digits: int) -> str:
        return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"

    for row in result["rows"]:
        lines.append(f"| {row['draft_length']} | {row['tree_width']} | {cell(row['accepted_per_pass'], 2)} | "
                     f"{cell(row['tree_union'], 1)} | {cell(row['branch_union'], 1)} | "
                     f"{cell(row['tokens_per_s'], 1)} |")
    return "\n".join(lines) + "\n"
