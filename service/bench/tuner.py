"""Tuner benchmark: an exhaustive grid vs the tuner's pick, on the same workload, in one run.

    python -m service.bench.tuner [--out DIR] [--trials 27] [--remeasure 3] ...   (or `moespec bench tuner`)
    moespec bench tuner --scenario noise [--seeds 5] [--trials 10] ...  (service/bench/tuner_noise.py)
    moespec bench tuner --scenario shift [--steady-seconds 30] ...      (service/bench/tuner_shift.py)
    moespec bench tuner --scenario whatif [--space length] [--seeds 16] ... (service/bench/tuner_whatif.py)

The default scenario (`grid`):

1. One server (embedded model), one closed-loop greedy load cycling the first --prompt-count prompts
   (a window is one pass over them, so every policy is measured on the same work), one span receiver.
2. Grid: every (drafter, draft_length, draft_temperature in {0, .5, 1, 1.5}) point, measured through
   the same trial window, without pruning (ground truth: every point gets its full window).
3. Tuner: a fresh study, TPE, `--trials` search trials + `--remeasure` re-measurements (30 in all by
   default), pruning on, exactly as `moespec tune` runs.
4. Side by side, interleaved rounds: grid best, tuner pick, default policy, plain decoding.
Targets (issue 5): tuner pick within 5% of the grid best's seconds per committed token, and a clear
gain over the default policy and plain decoding (or the tuner picks plain when plain is best).
Writes bench.json and bench.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import optuna

from service.errors import UsageError
from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy
from tuner.drivers.demo import DEFAULT_POLICY
from tuner.drivers.loadgen import DEFAULT_PROMPTS, TABLE_PROMPTS, LoadGenerator, LoadSpec, first_prompts, load_prompts
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.server_proc import start_server, telemetry_env
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, temperature_step
from tuner.loop.space import SearchSpace, policy_key
from tuner.loop.study import open_storage
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.compare import Compared, compare
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.spans import request_sample
from tuner.measurement.window import Objective, WindowSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Exhaustive grid vs the online tuner on one workload; writes bench.json / bench.md."
    parser.add_argument("--out", type=Path, default=None, help="output folder (default ./reports/bench-<timestamp>)")
    parser.add_argument("--scenario", choices=("grid", "noise", "shift", "whatif"), default="grid",
                        help="grid: exhaustive grid vs the tuner (default); noise: sequential vs paired trials "
                             "under a background CPU load switching every 10-30 s, several seeds "
                             "(service/bench/tuner_noise.py); shift: the continuous tuner under a workload shift, "
                             "a no-shift control and the cost of exploration (service/bench/tuner_shift.py); "
                             "whatif: the same study with and without the what-if hint, trials / policy switches "
                             "until a target policy is first measured (service/bench/tuner_whatif.py)")
    parser.add_argument("--trials", type=int, default=None,
                        help="tuner search trials (default 27; 10 per study for --scenario noise; for --scenario "
                             "whatif the space size with --space length, 14 with --space full)")
    parser.add_argument("--remeasure", type=int, default=None,
                        help="tuner re-measurements (default 3, so 27+3 = 30; 1 for --scenario noise)")
    parser.add_argument("--seeds", type=int, default=5, help="--scenario noise: seeds, each a sequential and a "
                                                              "paired study (default 5); --scenario whatif: seeds, "
                                                              "each a study without and with the hint")
    parser.add_argument("--space", choices=("length", "full"), default="length",
                        help="--scenario whatif: search only the draft length of one drafter at T=0 (default), "
                             "or the whole space")
    parser.add_argument("--length-drafters", type=_drafters, default=[Drafter.MODEL, Drafter.NGRAM],
                        help="--scenario whatif --space length: the drafters, comma-separated, each its own "
                             "search (default model,ngram)")
    parser.add_argument("--starts", type=_designs, default=[InitialDesign.CORNERS, InitialDesign.NONE],
                        help="--scenario whatif: initial designs, comma-separated, each its own set of studies "
                             "(default corners,none)")
    parser.add_argument("--load-workers", type=int, default=1,
                        help="--scenario noise: processes spinning a core each while the background load is on")
    parser.add_argument("--steady-seconds", type=float, default=30.0,
                        help="--scenario shift: exploring before the shift (or before the exploration cost in "
                             "the no-shift run; default 30)")
    parser.add_argument("--shift-timeout", type=float, default=300.0,
                        help="--scenario shift: give up waiting for a decision after this long (default 300)")
    parser.add_argument("--exploration-share", type=float, default=0.1, help="--scenario shift (default 0.1)")
    parser.add_argument("--reopen-trials", type=int, default=8, help="--scenario shift (default 8)")
    parser.add_argument("--shift-prompts", type=Path, default=TABLE_PROMPTS,
                        help="--scenario shift: the second workload (default service/prompts/tables.jsonl)")
    parser.add_argument("--shift-temperature", type=float, default=None, metavar="T",
                        help="--scenario shift: the shift keeps the prompts and the load samples at T instead "
                             "(a shift to sampled requests, where plain decoding is the cheapest)")
    parser.add_argument("--no-shift-only", action="store_true",
                        help="--scenario shift: only the no-shift control and the exploration cost")
    parser.add_argument("--shift-only", action="store_true",
                        help="--scenario shift: only the run with the workload shift")
    parser.add_argument("--exploration-rounds", type=int, default=6,
                        help="--scenario shift: challenge rounds measured for the exploration cost (default 6)")
    parser.add_argument("--exploration-gap", type=float, default=30.0,
                        help="--scenario shift: seconds the incumbent serves alone between those rounds (default 30)")
    parser.add_argument("--prompt-count", type=int, default=8,
                        help="cycle the first N shipped prompts (default 8), so every window serves the same work")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="committed tokens per window (default: prompt-count x max-new-tokens)")
    parser.add_argument("--min-steps", type=int, default=32, help="verify steps per window")
    parser.add_argument("--max-window-seconds", type=float, default=60.0)
    parser.add_argument("--compare-rounds", type=int, default=4, help="interleaved rounds of the final table")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="the requests' nucleus sampling (temperature > 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="server torch threads")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--skip-grid", action="store_true", help="tuner only (no ground truth)")
    parser.add_argument("--initial-design", choices=[d.value for d in InitialDesign],
                        default=InitialDesign.CORNERS.value,
                        help="what each fresh TPE study measures first (as moespec tune; default corners; "
                             "--scenario whatif takes --starts instead)")


def _drafters(text: str) -> list[Drafter]:
    try:
        return [Drafter(x.strip()) for x in text.split(",") if x.strip()] or [Drafter.MODEL]
    except ValueError:
        raise argparse.ArgumentTypeError(f"drafters are {', '.join(d.value for d in Drafter)}, got {text!r}") from None


def _designs(text: str) -> list[InitialDesign]:
    try:
        return [InitialDesign(x.strip()) for x in text.split(",") if x.strip()] or [InitialDesign.CORNERS]
    except ValueError:
        raise argparse.ArgumentTypeError(f"initial designs are {', '.join(d.value for d in InitialDesign)}, "
                                         f"got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from otel.receiver import OtlpTraceReceiver

    noise = args.scenario == "noise"
    if args.trials is None and args.scenario != "whatif":  # whatif: its own default per space (tuner_whatif.py)
        args.trials = 10 if noise else 27
    args.remeasure = args.remeasure if args.remeasure is not None else (1 if noise else 3)
    if ((args.trials is not None and args.trials < 1) or args.remeasure < 0 or args.compare_rounds < 1
            or args.seeds < 1 or args.load_workers < 1):
        raise UsageError("--trials, --compare-rounds, --seeds and --load-workers >= 1 and --remeasure >= 0 please")
    out = args.out or Path("reports") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    if args.scenario == "shift":
        from service.bench.tuner_shift import run_shift

        code = first_prompts(load_prompts(args.prompts), args.prompt_count)
        if args.min_tokens is None:
            args.min_tokens = len(code) * args.max_new_tokens
        shifted = code if args.shift_temperature is not None else \
            first_prompts(load_prompts(args.shift_prompts), args.prompt_count)
        return run_shift(args, code, shifted, out)
    if args.scenario == "whatif":
        from service.bench.tuner_whatif import run_whatif

        prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
        if args.min_tokens is None:
            args.min_tokens = len(prompts) * args.max_new_tokens
        return run_whatif(args, prompts, out)
    if noise:
        from service.bench.tuner_noise import run_noise

        prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
        if args.min_tokens is None:
            args.min_tokens = len(prompts) * args.max_new_tokens
        return run_noise(args, prompts, out)
    storage_url = f"sqlite:///{(out / 'bench.db').resolve()}"
    storage = open_storage(storage_url)
    prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
    if args.min_tokens is None:
        args.min_tokens = len(prompts) * args.max_new_tokens
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    err = sys.stderr
    token = secrets.token_hex(16)
    window = WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds)
    collector = SpanCollector(request_sample)
    stop_load = threading.Event()
    result: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")}}
    with ExitStack() as stack:
        receiver = OtlpTraceReceiver("127.0.0.1", 0, on_spans=collector.on_spans)
        receiver.start()
        stack.callback(receiver.stop, 0.5)
        server_args = ("--threads", str(args.threads)) if args.threads else ()
        server = stack.enter_context(start_server(telemetry_env(receiver.endpoint), token, server_args))
        client = stack.enter_context(MoespecClient(server.address, admin_token=token))
        client.wait_ready(timeout=60)
        load = LoadGenerator(client, prompts, LoadSpec(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                                       temperature=args.temperature, top_p=args.top_p,
                                                       seed=args.seed))
        load_thread = threading.Thread(target=load.run, args=(stop_load,), daemon=True)
        load_thread.start()
        stack.callback(load_thread.join, 30)
        stack.callback(stop_load.set)
        admin = PolicyAdmin(client, server.address)

        def study_run(name: str, sampler: SamplerKind, trials: int, remeasure: int, prune: PruneRule):
            settings = TuneSettings(study_name=name, trials=trials, tuner_id=f"bench:{name}", sampler=sampler,
                                    seed=args.seed, window=window, prune=prune, remeasure_top=remeasure,
                                    initial_design=InitialDesign(args.initial_design))
            built = assemble(settings, storage, admin, collector, ProgressPrinter(err))
            t0 = time.monotonic()
            best = built.tuner.run()
            return built, best, time.monotonic() - t0

        grid_best = None
        if not args.skip_grid:
            grid_space = SearchSpace.from_model_info(admin.model_info(), temperature_step=temperature_step(
                SamplerKind.GRID))
            size = len(initial_policies(SamplerKind.GRID, grid_space, InitialDesign.NONE))
            print(f"bench: grid of {size} policies, no pruning ...", file=err, flush=True)
            grid, grid_best, grid_seconds = study_run("grid", SamplerKind.GRID, size, 0, PruneRule(factor=0))
            result["grid"] = {"points": size, "seconds": round(grid_seconds, 1), "best": grid_best.key.label(),
                              "best_seconds_per_token": grid_best.mean}
        print("bench: tuner ...", file=err, flush=True)
        tuned, pick, tuner_seconds = study_run("tpe", SamplerKind.TPE, args.trials, args.remeasure, PruneRule())
        result["tuner"] = {"trials": len(tuned.study.trials), "seconds": round(tuner_seconds, 1),
                           "pick": pick.key.label(), "pick_seconds_per_token": pick.mean}

        policies = {"tuner": pick.policy}
        if grid_best is not None:
            policies["grid_best"] = grid_best.policy
        policies.update({"default": DEFAULT_POLICY, "plain": DraftPolicy(draft_length=0)})
        print(f"bench: side by side, {args.compare_rounds} rounds ...", file=err, flush=True)
        measurer = Measurer(admin, collector, MeasureConfig(window=window, prune=PruneRule(factor=0),
                                                            objective=Objective.MEASURED, cost=tuned.cost))
        table = compare(measurer, policies, args.compare_rounds, "bench/compare",
                        on_measured=lambda n, r, v: print(f"  {n} round {r}: {v * 1e3:.3f} ms/tok", file=err,
                                                          flush=True),
                        on_starved=lambda n, r, m: print(f"  {n} round {r} STARVED: {m.stats.requests} requests, "
                                                         f"{m.other_spans} spans of other ids in {m.seconds:.0f} s",
                                                         file=err, flush=True))
        stop_load.set()
    result["side_by_side"] = [c.as_dict(tuned.info.decode_step_seconds) for c in table]
    result["verdict"] = verdict(table, grid_best is not None)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "bench.md").write_text(markdown(result, table))
    print(markdown(result, table))
    return 0


def verdict(table: list[Compared], with_grid: bool) -> dict[str, object]:
    by = {c.name: c for c in table}
    tuner = by["tuner"].seconds_per_token
    v: dict[str, object] = {
        "tuner_vs_default": by["default"].seconds_per_token / tuner,
        "tuner_vs_plain": by["plain"].seconds_per_token / tuner,
        "tuner_picked_plain": by["tuner"].policy.draft_length == 0,
    }
    if with_grid:
        grid = by["grid_best"].seconds_per_token
        v["tuner_over_grid_best"] = tuner / grid
        v["within_5_percent"] = tuner <= 1.05 * grid
        v["same_policy"] = policy_key(by["tuner"].policy) == policy_key(by["grid_best"].policy)
    return v


def markdown(result: dict, table: list[Compared]) -> str:
    lines = ["| | policy | ms / committed token | per round (ms) |", "|---|---|---|---|"]
    for c in table:
        rounds = ", ".join(f"{x * 1e3:.3f}" for x in c.per_round)
        lines.append(f"| {c.name} | {policy_key(c.policy).label()} | {c.seconds_per_token * 1e3:.3f} | {rounds} |")
    lines.append("")
    if "grid" in result:
        g = result["grid"]
        lines.append(f"grid: {g['points']} points in {g['seconds']} s, best {g['best']} "
                     f"({g['best_seconds_per_token'] * 1e3:.3f} ms/tok in its grid window)")
    t = result["tuner"]
    lines.append(f"tuner: {t['trials']} trials in {t['seconds']} s, pick {t['pick']} "
                 f"({t['pick_seconds_per_token'] * 1e3:.3f} ms/tok mean of its measurements)")
    lines.append("verdict: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in result["verdict"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.bench.tuner")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
