"""Benchmark of the drafters through `moespec serve` with its defaults: does speculation pay, and do
the draft length and temperature matter?

    moespec bench draft [--requests 8] [--max-new-tokens 40] [--rounds 2] [--out DIR]

One server (`moespec serve --port 0`, defaults; `--draft-model` to serve another draft), one client
on loopback, two workloads on the same held-out prompts: greedy requests, and sampled ones
(`--temperature`, `--top-p`, a seed per prompt). Every round runs each (prompt, policy) pair once,
in a shuffled order (SetPolicy, then Generate: request-by-request interleaving, so drift on a shared
machine hits every policy alike). Policies: plain decoding, the n-gram drafter at `--ngram-lengths`,
the model drafter's chains at every `--lengths` x `--draft-temperatures`, and its trees at every
`--lengths` (the node budget) x `--tree-widths` (widths up to the budget) x `--tree-temperatures`.

Figures per workload and policy, from each round's own plain requests:
- speed: tokens/s over the round's requests of that policy / plain's (median, min..max over rounds);
- draft cost: draft seconds per drafted token / plain's verify seconds per step (responses' `spec`);
- verify cost: verify seconds per step / plain's, beside the per-layer distinct experts of a pass
  (a tree's: every node's) and the drafts accepted per verify pass;
- per workload: the best model-drafter policy, and at its draft length the worst draft temperature's
  cost per token over the best's; per node budget, the best tree's accepted drafts per pass beside the
  best chain's.
With `--out DIR`: draft-bench.json, draft-bench.md and draft-bench.png.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from service.bench.server import PROMPTS, ServeProcess
from service.server.client import MoespecClient
from service.types import MAX_TREE_WIDTH, Drafter, DraftPolicy, GenerationRequest, SamplingParams

PLAIN = DraftPolicy(Drafter.MODEL, 0, 0.0, policy_id="plain")


@dataclass(frozen=True)
class Row:
    workload: str
    policy: str  # "plain", "ngram k=4", "model k=3 T=0.5", "tree k=6 w=3 T=0"
    drafter: str
    draft_length: int
    draft_temperature: float
    tree_width: int  # 1: a chain
    speed: float  # x plain, median over rounds
    speed_min: float
    speed_max: float
    ms_per_token: float  # client wall time per output token, median over rounds
    acceptance: float  # accepted / drafted over every round
    accepted_per_pass: float  # accepted drafts per verify step over every round
    draft_cost: float  # draft seconds per drafted token / plain verify seconds per step (median over rounds)
    verify_cost: float  # verify seconds per step / plain's (median over rounds)
    unique_experts: tuple[float, ...]  # per layer, mean over the verify passes


def label(policy: DraftPolicy) -> str:
    if policy.draft_length == 0:
        return "plain"
    if policy.drafter is Drafter.NGRAM:
        return f"ngram k={policy.draft_length}"
    if policy.tree_width > 1:
        return f"tree k={policy.draft_length} w={policy.tree_width} T={policy.draft_temperature:g}"
    return f"model k={policy.draft_length} T={policy.draft_temperature:g}"


def policies(lengths: list[int], temperatures: list[float], ngram_lengths: list[int], tree_widths: list[int] = (),
             tree_temperatures: list[float] = ()) -> list[DraftPolicy]:
    out = [PLAIN]
    out += [DraftPolicy(Drafter.NGRAM, k, 0.0, policy_id=f"ngram-k{k}") for k in ngram_lengths]
    out += [DraftPolicy(Drafter.MODEL, k, t, policy_id=f"model-k{k}-t{t:g}") for k in lengths for t in temperatures]
    out += [DraftPolicy(Drafter.MODEL, k, t, policy_id=f"tree-k{k}-w{w}-t{t:g}", tree_width=w)
            for k in lengths for w in tree_widths if 1 < w <= k for t in tree_temperatures]
    return out


def workloads(prompts: list[str], max_new_tokens: int, temperature: float, top_p: float) -> dict[str, list]:
    greedy = [GenerationRequest(prompt=p, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0.0))
              for p in prompts]
    sampled = [GenerationRequest(prompt=p, max_new_tokens=max_new_tokens,
                                 sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=i))
               for i, p in enumerate(prompts)]
    return {"greedy": greedy, f"sampled T={temperature:g} top-p={top_p:g}": sampled}


def run_rounds(client: MoespecClient, loads: dict[str, list], grid: list[DraftPolicy], rounds: int,
               seed: int) -> list[dict]:
    """-> per round, per (workload, policy label): summed tokens, seconds and spec fields."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        pairs = [(name, i, p) for name, requests in loads.items() for i in range(len(requests)) for p in grid]
        rng.shuffle(pairs)
        sums: dict[tuple[str, str], dict] = defaultdict(lambda: defaultdict(float))
        for name, i, policy in pairs:
            client.set_policy(policy)
            t0 = time.perf_counter()
            reply = client.generate(loads[name][i], timeout=300)
            seconds = time.perf_counter() - t0
            s = sums[name, label(policy)]
            s["tokens"] += reply.completion_tokens
            s["seconds"] += seconds
            s["steps"] += reply.spec.verify_steps
            s["drafted"] += reply.spec.drafted_tokens
            s["accepted"] += reply.spec.accepted_tokens
            s["draft_seconds"] += reply.spec.draft_seconds
            s["verify_seconds"] += reply.spec.verify_seconds
            layers = s.setdefault("experts", [0.0] * len(reply.spec.unique_experts_mean))
            for j, x in enumerate(reply.spec.unique_experts_mean):
                layers[j] += x * reply.spec.verify_steps
        out.append(sums)
    return out


def summarise(per_round: list[dict], grid: list[DraftPolicy], loads: dict[str, list]) -> list[Row]:
    rows = []
    for name in loads:
        for policy in grid:
            key, plain_key = (name, label(policy)), (name, "plain")
            speeds, ms, draft_costs, verify_costs = [], [], [], []
            drafted = accepted = steps = 0.0
            experts = None
            for sums in per_round:
                s, p = sums[key], sums[plain_key]
                unit = p["verify_seconds"] / p["steps"]
                speeds.append((s["tokens"] / s["seconds"]) / (p["tokens"] / p["seconds"]))
                ms.append(1000 * s["seconds"] / s["tokens"])
                verify_costs.append(s["verify_seconds"] / s["steps"] / unit)
                if s["drafted"]:
                    draft_costs.append(s["draft_seconds"] / s["drafted"] / unit)
                drafted, accepted, steps = drafted + s["drafted"], accepted + s["accepted"], steps + s["steps"]
                experts = [a + b for a, b in zip(experts or [0.0] * len(s["experts"]), s["experts"], strict=True)]
            rows.append(Row(
                workload=name, policy=label(policy), drafter=policy.drafter.value, draft_length=policy.draft_length,
                draft_temperature=policy.draft_temperature, tree_width=policy.tree_width,
                speed=statistics.median(speeds), speed_min=min(speeds),
                speed_max=max(speeds), ms_per_token=statistics.median(ms),
                acceptance=accepted / drafted if drafted else 0.0, accepted_per_pass=accepted / steps,
                draft_cost=statistics.median(draft_costs) if draft_costs else 0.0,
                verify_cost=statistics.median(verify_costs), unique_experts=tuple(x / steps for x in experts)))
    return rows


def headline(rows: list[Row]) -> dict[str, dict]:
    """Per workload: best model-drafter and n-gram policies, and the draft-temperature spread at the
    best model draft length (worst cost per token / best)."""
    out = {}
    for name in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == name]
        model = [r for r in mine if r.drafter == "model" and r.draft_length]
        ngram = [r for r in mine if r.drafter == "ngram"]
        best = max(model, key=lambda r: r.speed)
        same_k = [r for r in model if r.draft_length == best.draft_length]
        out[name] = {
            "best_model": best.policy, "best_model_speed": round(best.speed, 3),
            "best_model_speed_range": [round(best.speed_min, 3), round(best.speed_max, 3)],
            "best_model_draft_cost": round(best.draft_cost, 3),
            "best_ngram": max(ngram, key=lambda r: r.speed).policy if ngram else None,
            "best_ngram_speed": round(max(r.speed for r in ngram), 3) if ngram else None,
            "draft_temperature_spread_at_best_k": round(max(r.ms_per_token for r in same_k)
                                                        / min(r.ms_per_token for r in same_k), 3),
            "verify_cost_k4": next((round(r.verify_cost, 3) for r in model if r.draft_length == 4), None),
            "unique_experts_k4": next((list(map(lambda x: round(x, 1), r.unique_experts))
                                       for r in model if r.draft_length == 4), None),
            "trees_against_chains": trees_against_chains(model),
        }
    return out


def trees_against_chains(model: list[Row]) -> list[dict]:
    """Per node budget with a tree: the best tree and the best chain by accepted drafts per pass, and
    both policies' speed (a tree is accepted more; whether it pays is the speed)."""
    out = []
    for k in sorted({r.draft_length for r in model if r.tree_width > 1}):
        trees = [r for r in model if r.draft_length == k and r.tree_width > 1]
        chains = [r for r in model if r.draft_length == k and r.tree_width == 1]
        if not chains:
            continue
        tree, chain = max(trees, key=lambda r: r.accepted_per_pass), max(chains, key=lambda r: r.accepted_per_pass)
        out.append({"node_budget": k, "tree": tree.policy, "tree_accepted_per_pass": round(tree.accepted_per_pass, 2),
                    "tree_speed": round(tree.speed, 3), "chain": chain.policy,
                    "chain_accepted_per_pass": round(chain.accepted_per_pass, 2), "chain_speed": round(chain.speed, 3)})
    return out


def format_report(rows: list[Row], heads: dict[str, dict], rounds: int) -> str:
    lines = []
    for name, h in heads.items():
        lines += [f"## {name} ({rounds} interleaved rounds; speed x plain: median, min..max over rounds)", "",
                  "| policy | speed x plain | ms / token | acceptance | accepted / pass | draft token (plain steps) | "
                  "verify pass (plain steps) | unique experts / layer |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r.workload == name):
            lines.append(f"| {r.policy} | {r.speed:.2f} ({r.speed_min:.2f}..{r.speed_max:.2f}) | "
                         f"{r.ms_per_token:.2f} | {r.acceptance:.2f} | {r.accepted_per_pass:.2f} | "
                         f"{r.draft_cost:.3f} | {r.verify_cost:.2f} | "
                         f"{', '.join(f'{x:.1f}' for x in r.unique_experts)} |")
        lines += ["", f"best model drafter: {h['best_model']} at {h['best_model_speed']:.2f}x plain "
                      f"({h['best_model_speed_range'][0]:.2f}..{h['best_model_speed_range'][1]:.2f}), a drafted "
                      f"token {h['best_model_draft_cost']:.3f} of a plain step; best n-gram: {h['best_ngram']} at "
                      f"{h['best_ngram_speed']}x; at that draft length the worst draft temperature costs "
                      f"{h['draft_temperature_spread_at_best_k']:.2f}x the best per token", ""]
        for t in h["trees_against_chains"]:
            lines.append(f"- {t['node_budget']} drafts per pass: best tree {t['tree']} accepts "
                         f"{t['tree_accepted_per_pass']:.2f} per pass ({t['tree_speed']:.2f}x plain), best chain "
                         f"{t['chain']} {t['chain_accepted_per_pass']:.2f} ({t['chain_speed']:.2f}x plain)")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(6 * (len(names) + 1), 4.5))
    for ax, name in zip(axes, names, strict=False):
        model = [r for r in rows if r.workload == name and r.drafter == "model" and r.draft_length]
        for t in sorted({r.draft_temperature for r in model if r.tree_width == 1}):
            pts = sorted((r.draft_length, r.speed) for r in model if r.draft_temperature == t and r.tree_width == 1)
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"model chain, draft T={t:g}")
        for w, t in sorted({(r.tree_width, r.draft_temperature) for r in model if r.tree_width > 1}):
            pts = sorted((r.draft_length, r.speed) for r in model if (r.tree_width, r.draft_temperature) == (w, t))
            ax.plot(*zip(*pts, strict=True), marker="^", ls=":", label=f"model tree w={w}, draft T={t:g}")
        ngram = sorted((r.draft_length, r.speed) for r in rows if r.workload == name and r.drafter == "ngram")
        if ngram:
            ax.plot(*zip(*ngram, strict=True), "k--", marker="s", label="n-gram")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("draft length (a tree's node budget)")
        ax.set_ylabel("tokens/s x plain (median over rounds)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    ax = axes[-1]
    greedy = [r for r in rows if r.workload == names[0] and r.drafter == "model" and r.draft_temperature == 0
              and r.tree_width == 1]
    for layer in range(len(greedy[0].unique_experts) if greedy else 0):
        ax.plot([r.draft_length for r in greedy], [r.unique_experts[layer] for r in greedy], marker="o",
                label=f"layer {layer}")
    ax.set_xlabel("draft length (model drafter, greedy)")
    ax.set_ylabel("distinct routed experts per verify pass")
    ax.set_title("Union of experts vs draft length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=8, help="held-out prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every (prompt, policy)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="model draft lengths")
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.2])
    parser.add_argument("--ngram-lengths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tree-widths", type=int, nargs="*", default=[2, 3],
                        help="draft tree widths, each at every --lengths node budget it fits (none: chains only)")
    parser.add_argument("--tree-temperatures", type=float, nargs="+", default=[0.0],
                        help="draft temperatures of the trees (they rank the candidates)")
    parser.add_argument("--temperature", type=float, default=0.8, help="the sampled workload's temperature")
    parser.add_argument("--top-p", type=float, default=0.95, help="the sampled workload's top-p")
    parser.add_argument("--draft-model", type=Path, default=None, help="serve this draft (default: the shipped head)")
    parser.add_argument("--seed", type=int, default=0, help="order of the shuffled rounds")
    parser.add_argument("--out", type=Path, default=None, help="folder for draft-bench.json, .md and .png")


def run(args: argparse.Namespace) -> int:
    from service.errors import UsageError

    if min(args.requests, args.max_new_tokens, args.rounds, *args.lengths) < 1 or min(args.draft_temperatures) < 0:
        raise UsageError("--requests, --max-new-tokens, --rounds and --lengths must be >= 1, "
                         "--draft-temperatures >= 0")
    if not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise UsageError("--temperature must be > 0 and --top-p in (0, 1]")
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:args.requests]]
    loads = workloads(prompts, args.max_new_tokens, args.temperature, args.top_p)
    if args.tree_widths and not all(1 < w <= MAX_TREE_WIDTH for w in args.tree_widths):
        raise UsageError(f"--tree-widths must lie in [2, {MAX_TREE_WIDTH}]")
    grid = policies(args.lengths, args.draft_temperatures, args.ngram_lengths, args.tree_widths,
                    args.tree_temperatures)
    token = secrets.token_hex(16)
    server_args = ["--port", "0", "--admin-token", token]
    if args.draft_model is not None:
        server_args += ["--draft-model", str(args.draft_model)]
    with ServeProcess(server_args) as address, MoespecClient(address, admin_token=token) as client:
        client.wait_ready(timeout=120)
        for request in loads["greedy"][:2]:  # warm-up: first calls pay one-off costs
            client.generate(request)
        per_round = run_rounds(client, loads, grid, args.rounds, args.seed)
    rows = summarise(per_round, grid, loads)
    heads = headline(rows)
    report = format_report(rows, heads, args.rounds)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        figures = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                              if not k.startswith("_")},
                   "headline": heads, "rows": [asdict(r) for r in rows]}
        (args.out / "draft-bench.json").write_text(json.dumps(figures, indent=2) + "\n")
        (args.out / "draft-bench.md").write_text(report + "\n")
        plot(rows, args.out / "draft-bench.png")
        print(f"wrote {args.out}/draft-bench.json, .md and .png")
    return 0
