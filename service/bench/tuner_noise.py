"""`moespec bench tuner --scenario noise`: sequential vs controlled (paired / interleaved) trials on a
machine whose speed changes.

1. One rig (server, receiver, closed-loop greedy load over the first --prompt-count prompts).
2. Ground truth: the exhaustive grid, quiet machine, no pruning (skip with --skip-grid: then the
   best policy measured side by side in step 4 stands in for it).
3. For each of --seeds: the same TPE study (--trials search trials, --remeasure) run sequentially
   (the old way) and with the tuner's controlled trials (its own choice for the server: paired
   traffic splits, or control/candidate/control windows where requests share target passes), each
   under a bench-owned background CPU load (tuner.drivers.cpuload) that switches on and off every 10-30 s;
   the order of the two alternates between seeds.
4. Quiet machine again: every distinct pick and plain decoding, each against the grid best in the
   same round (one traffic split request by request; back-to-back windows of their own, order
   alternating, where requests share passes: a split would bias the ratio), --compare-rounds
   rounds, order rotated. A pick's score is its cost ratio to the grid best pooled over the rounds
   (with a 95% interval); <= 1.05 counts as a hit (target: controlled >= 4 of 5). Per round,
   because the absolute side-by-side this replaced swung +-40% between rounds on this shared machine.
Writes noise.json, noise.md and noise.png to --out and prints the table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import optuna

from service.types import DraftPolicy
from tuner.drivers.cpuload import BackgroundLoad
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.rig import Rig, RigSpec, open_rig
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, temperature_step
from tuner.loop.space import SearchSpace, policy_key
from tuner.loop.study import open_storage
from tuner.measurement.compare import compare, compare_paired
from tuner.measurement.measure import MeasureConfig, Measurer, TrialMode
from tuner.measurement.window import CostModel, Objective, WindowSpec

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
                                    seed=seed, window=window, prune=prune, remeasure_top=remeasure, trial_mode=mode,
                                    initial_design=InitialDesign(args.initial_design))
            built = assemble(settings, storage, rig.admin, rig.collector, ProgressPrinter(err))
            t0 = time.monotonic()
            best = built.tuner.run()
            return built, best, time.monotonic() - t0

        grid_best = None
        if not args.skip_grid:
            space = SearchSpace.from_model_info(rig.admin.model_info(),
                                                temperature_step=temperature_step(SamplerKind.GRID))
            size = len(initial_policies(SamplerKind.GRID, space, InitialDesign.NONE))
            print(f"bench noise: grid of {size} policies, quiet machine ...", file=err, flush=True)
            _, grid_best, seconds = study("grid", SamplerKind.GRID, size, 0, TrialMode.SEQUENTIAL,
                                          PruneRule(factor=0), args.seed)
            result["grid"] = {"points": size, "seconds": round(seconds, 1), "best": grid_best.key.label()}
        for i, seed in enumerate(seeds):
            # None: the tuner's own choice for this server (paired, or interleaved where requests share passes).
            modes = [TrialMode.SEQUENTIAL, None]
            for mode in modes if i % 2 == 0 else modes[::-1]:
                name = mode.value if mode else "controlled"
                print(f"bench noise: seed {seed}, {name}, background load on/off every 10-30 s ...",
                      file=err, flush=True)
                with BackgroundLoad(seed * 7919 + (mode is None), workers=args.load_workers) as bg:
                    built, pick, seconds = study(f"{name}-{seed}", SamplerKind.TPE, args.trials, args.remeasure,
                                                 mode, PruneRule(), seed)
                result["runs"].append({"seed": seed, "mode": built.mode.value, "controlled": mode is None,
                                       "pick": pick.key.label() if pick else None,
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


def side_by_side(args, rig: Rig, window: WindowSpec, grid_best: DraftPolicy | None, runs: list[dict]) -> dict:
    """Every distinct pick and plain decoding, each paired with the reference (the grid best) in one
    traffic split per round, --compare-rounds rounds, order rotated. Without a grid, the reference
    is first chosen by an absolute side-by-side (tuner.measurement.compare) of the same policies."""
    policies: dict[str, DraftPolicy] = {"plain": DraftPolicy(draft_length=0)}
    for r in runs:
        if r["pick_policy"] is not None:
            policies.setdefault(r["pick"], r["pick_policy"])
    measurer = Measurer(rig.admin, rig.collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                                objective=Objective.MEASURED, cost=CostModel(0)))
    err = sys.stderr
    kind = "grid best"
    if grid_best is None:
        print(f"bench noise: no grid: choosing the reference among {len(policies)} policies side by side ...",
              file=err, flush=True)
        absolute = compare(measurer, policies, args.compare_rounds, "bench/noise-abs")
        grid_best = min((c for c in absolute if c.stats.committed), key=lambda c: c.seconds_per_token).policy
        kind = "best measured side by side (no grid)"
    label = policy_key(grid_best).label()
    print(f"bench noise: {len(policies)} policies each paired with {label}, {args.compare_rounds} rounds, "
          "quiet machine ...", file=err, flush=True)
    shared = rig.admin.model_info().shared_passes
    paired = compare_paired(measurer, grid_best, policies, args.compare_rounds, "bench/noise", shared_passes=shared)
    return {"reference": {"policy": label, "kind": kind, "back_to_back": shared},
            "rows": [c.as_dict() for c in paired]}


def score(result: dict, table: dict) -> None:
    """A pick is within 5% when its paired ratio to the reference (pooled over the rounds) is <= 1.05;
    the reference itself scores 1. Its interval says how sure that is (reported, not used)."""
    ratio = {row["policy"]: row for row in table["rows"] if row["paired_ratio"] is not None}
    ref = table["reference"]["policy"]
    result["reference"] = table["reference"]
    plain = ratio.get("plain")
    for r in result["runs"]:
        row = ratio.get(r["pick"])
        over = 1.0 if r["pick"] == ref else (row["paired_ratio"] if row else None)
        r["over_reference"] = over
        r["over_reference_interval"] = ([1.0, 1.0] if r["pick"] == ref else
                                        [row["paired_ratio_low"], row["paired_ratio_high"]] if row else None)
        r["within_5_percent"] = over is not None and over <= WITHIN
        r["over_plain"] = over / plain["paired_ratio"] if over and plain else None
    for arm, controlled in (("sequential", False), ("controlled", True)):
        runs = [r for r in result["runs"] if r["controlled"] is controlled]
        result[f"{arm}_hits"] = f"{sum(r['within_5_percent'] for r in runs)}/{len(runs)}"


def _interval(pair: list | None) -> str:
    return f"{pair[0]:.3f}-{pair[1]:.3f}" if pair and None not in pair else "-"


def markdown(result: dict) -> str:
    ref = result["reference"]
    how = ("in back-to-back windows of its own per round, the order alternating (requests share target passes on "
           "this server, so a traffic split would bias the ratio)" if ref.get("back_to_back")
           else "in one traffic split per round")
    lines = [f"Reference: {ref['policy']} ({ref['kind']}). Each pick and plain decoding ran beside it {how}; cost "
             "ratios pooled over the rounds, 95% intervals.",
             "",
             "| seed | mode | pick | pick / reference | 95% interval | pick / plain | within 5% | load on | tuning s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        over = f"{r['over_reference']:.3f}" if r["over_reference"] else "-"
        plain = f"{r['over_plain']:.3f}" if r["over_plain"] else "-"
        lines.append(f"| {r['seed']} | {r['mode']} | {r['pick']} | {over} | {_interval(r['over_reference_interval'])} "
                     f"| {plain} | {'yes' if r['within_5_percent'] else 'no'} | {r['load_on_fraction']:.0%} "
                     f"| {r['seconds']} |")
    lines += ["", f"within 5% of the reference (ratio <= 1.05): the tuner's controlled trials "
              f"{result['controlled_hits']}, "
              f"sequential {result['sequential_hits']}", "",
              "| policy | / reference (pooled) | 95% interval | per round | ms / token (its arm) |",
              "|---|---|---|---|---|"]
    for row in result["side_by_side"]["rows"]:
        ratio = f"{row['paired_ratio']:.3f}" if row["paired_ratio"] else "-"
        rounds = ", ".join(f"{x:.3f}" if x else "-" for x in row["per_round"])
        spt = f"{row['seconds_per_token'] * 1e3:.2f}" if row["seconds_per_token"] else "-"
        lines.append(f"| {row['policy']} | {ratio} | {_interval([row['paired_ratio_low'], row['paired_ratio_high']])} "
                     f"| {rounds} | {spt} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for offset, (controlled, color) in enumerate(((False, "tab:grey"), (True, "tab:green"))):
        runs = [r for r in result["runs"] if r["controlled"] is controlled]
        label = runs[0]["mode"] if runs else ("controlled" if controlled else "sequential")
        ax.bar([r["seed"] + (offset - 0.5) * 0.4 for r in runs], [r["over_reference"] or 0 for r in runs],
               width=0.4, color=color, label=label)
    ax.axhline(WITHIN, color="tab:red", linestyle="--", linewidth=1, label="+5%")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("seed")
    ax.set_ylabel("pick cost / reference (pooled over rounds)")
    ax.set_title("Picks under a background load switching every 10-30 s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
