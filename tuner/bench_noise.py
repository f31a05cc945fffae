"""`moespec bench tuner --scenario noise`: sequential vs paired trials on a machine whose speed changes.

1. One rig (server, receiver, closed-loop greedy load over the first --prompt-count prompts).
2. Ground truth: the exhaustive grid, quiet machine, no pruning (skip with --skip-grid: then the
   best policy measured side by side in step 4 stands in for it).
3. For each of --seeds: the same TPE study (--trials search trials, --remeasure) run sequentially
   (the old way) and paired, each under a bench-owned background CPU load (tuner.cpuload) that
   switches on and off every 10-30 s; the order of the two alternates between seeds.
4. Quiet machine again: every distinct pick, the grid best and plain decoding measured side by side
   in --compare-rounds interleaved rounds. Each pick's cost over the grid best's is its score;
   within 5% counts as a hit (target: paired >= 4 of 5).
Writes noise.json, noise.md and noise.png to --out and prints the table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import optuna

from service.types import DraftPolicy
from tuner.assemble import TuneSettings, assemble
from tuner.compare import compare
from tuner.cpuload import BackgroundLoad
from tuner.measure import MeasureConfig, Measurer, TrialMode
from tuner.progress import ProgressPrinter
from tuner.pruning import PruneRule
from tuner.rig import Rig, RigSpec, open_rig
from tuner.sampler import SamplerKind, initial_policies, temperature_step
from tuner.space import SearchSpace, policy_key
from tuner.study import open_storage
from tuner.window import CostModel, Objective, WindowSpec

WITHIN = 1.05


def run_noise(args, prompts: list[str], out: Path) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    err = sys.stderr
    storage = open_storage(f"sqlite:///{(out / 'noise.db').resolve()}")
    window = WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds)
    seeds = list(range(args.seed, args.seed + args.seeds))
    result: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                                 "runs": []}
    spec = RigSpec(prompts, args.concurrency, args.max_new_tokens, args.temperature, args.seed, args.threads)
    with open_rig(spec) as rig:
        def study(name: str, sampler: SamplerKind, trials: int, remeasure: int, mode: TrialMode | None,
                  prune: PruneRule, seed: int):
            settings = TuneSettings(study_name=name, trials=trials, tuner_id=f"bench:{name}", sampler=sampler,
                                    seed=seed, window=window, prune=prune, remeasure_top=remeasure, trial_mode=mode)
            built = assemble(settings, storage, rig.admin, rig.collector, ProgressPrinter(err))
            t0 = time.monotonic()
            best = built.tuner.run()
            return built, best, time.monotonic() - t0

        grid_best = None
        if not args.skip_grid:
            space = SearchSpace.from_model_info(rig.admin.model_info(),
                                                temperature_step=temperature_step(SamplerKind.GRID))
            size = len(initial_policies(SamplerKind.GRID, space, baselines=False))
            print(f"bench noise: grid of {size} policies, quiet machine ...", file=err, flush=True)
            _, grid_best, seconds = study("grid", SamplerKind.GRID, size, 0, TrialMode.SEQUENTIAL,
                                          PruneRule(factor=0), args.seed)
            result["grid"] = {"points": size, "seconds": round(seconds, 1), "best": grid_best.key.label()}
        for i, seed in enumerate(seeds):
            modes = [TrialMode.SEQUENTIAL, TrialMode.PAIRED]
            for mode in modes if i % 2 == 0 else modes[::-1]:
                print(f"bench noise: seed {seed}, {mode.value}, background load on/off every 10-30 s ...",
                      file=err, flush=True)
                with BackgroundLoad(seed * 7919 + (mode is TrialMode.PAIRED), workers=args.load_workers) as bg:
                    built, pick, seconds = study(f"{mode.value}-{seed}", SamplerKind.TPE, args.trials, args.remeasure,
                                                 mode, PruneRule(), seed)
                result["runs"].append({"seed": seed, "mode": mode.value, "pick": pick.key.label() if pick else None,
                                       "pick_policy": pick.policy if pick else None, "seconds": round(seconds, 1),
                                       "trials": len(built.study.trials),
                                       "load_on_fraction": round(bg.on_fraction, 2)})
        table = side_by_side(args, rig, window, grid_best.policy if grid_best else None, result["runs"])
    result["side_by_side"] = table
    score(result, table)
    for r in result["runs"]:
        r.pop("pick_policy", None)
    (out / "noise.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (out / "noise.md").write_text(md)
    plot(result, out / "noise.png")
    print(md)
    return 0


def side_by_side(args, rig: Rig, window: WindowSpec, grid_best: DraftPolicy | None, runs: list[dict]) -> list[dict]:
    policies: dict[str, DraftPolicy] = {}
    if grid_best is not None:
        policies[policy_key(grid_best).label()] = grid_best
    policies.setdefault("plain", DraftPolicy(draft_length=0))
    for r in runs:
        if r["pick_policy"] is not None:
            policies.setdefault(r["pick"], r["pick_policy"])
    measurer = Measurer(rig.admin, rig.collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                                objective=Objective.MEASURED, cost=CostModel(0)))
    print(f"bench noise: {len(policies)} policies side by side, {args.compare_rounds} rounds, quiet machine ...",
          file=sys.stderr, flush=True)
    compared = compare(measurer, policies, args.compare_rounds, "bench/noise")
    return [{"policy": c.name, "seconds_per_token": c.seconds_per_token if c.stats.committed else None,
             "per_round": [x if x != float("inf") else None for x in c.per_round],
             "is_grid_best": grid_best is not None and c.name == policy_key(grid_best).label()} for c in compared]


def score(result: dict, table: list[dict]) -> None:
    cost = {row["policy"]: row["seconds_per_token"] for row in table if row["seconds_per_token"]}
    reference = next((row for row in table if row["is_grid_best"]), None)
    ref_label = reference["policy"] if reference else min(cost, key=cost.get)
    result["reference"] = {"policy": ref_label, "seconds_per_token": cost[ref_label],
                           "kind": "grid best" if reference else "best measured side by side (no grid)"}
    for r in result["runs"]:
        c = cost.get(r["pick"])
        r["over_reference"] = c / cost[ref_label] if c else None
        r["within_5_percent"] = c is not None and c <= WITHIN * cost[ref_label]
        r["over_plain"] = c / cost["plain"] if c and cost.get("plain") else None
    for mode in ("sequential", "paired"):
        runs = [r for r in result["runs"] if r["mode"] == mode]
        result[f"{mode}_hits"] = f"{sum(r['within_5_percent'] for r in runs)}/{len(runs)}"


def markdown(result: dict) -> str:
    ref = result["reference"]
    lines = [f"Reference: {ref['policy']} ({ref['kind']}), {ref['seconds_per_token'] * 1e3:.3f} ms/token side by side.",
             "", "| seed | mode | pick | pick / reference | pick / plain | within 5% | load on | tuning s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        over = f"{r['over_reference']:.3f}" if r["over_reference"] else "-"
        plain = f"{r['over_plain']:.3f}" if r["over_plain"] else "-"
        lines.append(f"| {r['seed']} | {r['mode']} | {r['pick']} | {over} | {plain} | "
                     f"{'yes' if r['within_5_percent'] else 'no'} | {r['load_on_fraction']:.0%} | {r['seconds']} |")
    lines += ["", f"within 5% of the reference: paired {result['paired_hits']}, "
              f"sequential {result['sequential_hits']}", "", "| policy | ms / token side by side | per round |",
              "|---|---|---|"]
    for row in result["side_by_side"]:
        spt = f"{row['seconds_per_token'] * 1e3:.3f}" if row["seconds_per_token"] else "-"
        rounds = ", ".join(f"{x * 1e3:.2f}" if x else "-" for x in row["per_round"])
        lines.append(f"| {row['policy']} | {spt} | {rounds} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for offset, (mode, color) in enumerate((("sequential", "tab:grey"), ("paired", "tab:green"))):
        runs = [r for r in result["runs"] if r["mode"] == mode]
        ax.bar([r["seed"] + (offset - 0.5) * 0.4 for r in runs], [r["over_reference"] or 0 for r in runs],
               width=0.4, color=color, label=mode)
    ax.axhline(WITHIN, color="tab:red", linestyle="--", linewidth=1, label="+5%")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("seed")
    ax.set_ylabel("pick cost / reference (side by side)")
    ax.set_title("Picks under a background load switching every 10-30 s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
