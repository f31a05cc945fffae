"""`moespec bench fleet`: one `moespec tune` worker vs N workers (one per replica) on the same trial
budget, each search in its own study of one PostgreSQL (--storage), and the picks' quality.

1. N replicas on loopback (`moespec serve`, one torch thread and one kernel thread each, so the
   cores are shared alike), each with its own closed-loop load generator for the whole run.
2. One worker on replica 0, --trials search trials: wall time from its start until it exits.
3. N workers, one per replica, the same --trials for the whole fleet: wall time until all exit.
   Workers run with `moespec tune`'s own defaults (window, re-measures, pruning) unless a flag here
   overrides them, so the figure is what a user's fleet gets; each worker's progress lines, stamped
   with seconds since its search began, are kept in --out (where the time went: start-up, windows).
4. Afterwards, on replica 0 alone: a reference grid over the space (plain, n-gram k=2/4/8, model
   k=2/4/6/8 at T=0) and the picks, measured interleaved in --compare-rounds rounds (order
   rotated); a pick that is a grid policy is that policy's measurement, not a second one. A pick's
   quality is its cost over the grid best's, with the spread of the per-round ratios (target: N
   workers within 5% of the grid best in <= 0.5x the wall time of one).
Writes fleet.json, fleet.md and fleet.png to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna

from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, load_prompts
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server, telemetry_env
from tuner.loop.pruning import PruneRule
from tuner.loop.space import SearchSpace, policy_key
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.compare import compare
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.span_admission import SpanAdmission
from tuner.measurement.spans import request_sample
from tuner.measurement.window import CostModel, Objective, WindowSpec

TOKEN = "bench-fleet-token"
SERVE = ("--threads", "1", "--kernel-threads", "1", "--max-batch", "2")
GRID = {"plain": DraftPolicy(draft_length=0),
        **{f"ngram k={k}": DraftPolicy(Drafter.NGRAM, k, 1.0) for k in (2, 4, 8)},
        **{f"model k={k} T=0": DraftPolicy(Drafter.MODEL, k, 0.0) for k in (2, 4, 6, 8)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", required=True, help="PostgreSQL URL (postgresql+psycopg2://...) for the studies")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--trials", type=int, default=30,
                        help="search trials, for one worker and for the fleet (default 30, as `moespec tune`)")
    parser.add_argument("--tune-args", default="", metavar="ARGS",
                        help="extra `moespec tune` flags for every worker, e.g. '--min-tokens 128 --remeasure 1' "
                             "(default: none, tune's own defaults)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per load-generator request")
    parser.add_argument("--compare-tokens", type=int, default=512, help="committed tokens per comparison window")
    parser.add_argument("--compare-rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-fleet"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _search(args, replicas, study: str, workers: int) -> tuple[float, dict]:
    """`workers` tune processes on the first `workers` replicas, one study -> (wall seconds, winner)."""
    procs = []
    start = time.monotonic()
    for i in range(workers):
        address, port = replicas[i]
        cmd = [*MOESPEC, "tune", "--server", address, "--otlp-listen", f"127.0.0.1:{port}", "--storage", args.storage,
               "--study", study, "--trials", str(args.trials), "--tuner-id", f"w{i}", "--seed", str(args.seed + i),
               "--admin-token", TOKEN, *shlex.split(args.tune_args)]
        log = args.out / f"{study}-w{i}.log"
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""})
        keeper = threading.Thread(target=_keep_timed, args=(proc.stdout, log, start), daemon=True)
        keeper.start()
        procs.append((proc, keeper, log))
    for proc, keeper, _ in procs:
        proc.wait()
        keeper.join(10)
    wall = time.monotonic() - start
    for proc, _, log in procs:
        if proc.returncode != 0:
            raise RuntimeError(f"a worker exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return wall, optuna.load_study(study_name=study, storage=args.storage).user_attrs["winner"]


def _keep_timed(stream, log: Path, start: float) -> None:
    """A worker's progress lines into `log`, each stamped with seconds since the search started:
    where a search's wall time goes (start-up, windows, re-measures) is read off these."""
    with log.open("w") as out:
        for line in stream:
            out.write(f"{time.monotonic() - start:7.1f} s  {line}")
            out.flush()


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse before starting anything: a run takes minutes and several servers."""
    from service.errors import UsageError

    if not args.storage.startswith(("postgresql", "mysql")):
        raise UsageError("--storage: the workers share one study over the network: give a postgresql:// "
                         f"(or mysql://) URL, not {args.storage.split(':', 1)[0]!r}")
    if args.replicas < 2 or args.trials < 1 or args.compare_rounds < 1 or args.compare_tokens < 8:
        raise UsageError("--replicas must be >= 2, --trials and --compare-rounds >= 1, --compare-tokens >= 8")
    try:
        shlex.split(args.tune_args)
    except ValueError as e:
        raise UsageError(f"--tune-args: {e}") from None


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = time.strftime("%Y%m%d%H%M%S")
    servers, loads, stop = [], [], threading.Event()
    try:
        for _ in range(args.replicas):
            port = _free_port()
            servers.append((start_server(telemetry_env(f"http://127.0.0.1:{port}"), TOKEN, SERVE), port))
        replicas = [(s.address, port) for s, port in servers]
        for address, _ in replicas:
            client = MoespecClient(address, admin_token=TOKEN)
            client.wait_ready(timeout=60)
            gen = LoadGenerator(client, load_prompts(DEFAULT_PROMPTS),
                                LoadSpec(concurrency=1, max_new_tokens=args.max_new_tokens, seed=args.seed))
            loads.append((client, threading.Thread(target=gen.run, args=(stop,), daemon=True)))
            loads[-1][1].start()
        searches = {}
        for workers in (1, args.replicas):
            study = f"bench-fleet-{workers}-{tag}"
            wall, winner = _search(args, replicas, study, workers)
            searches[str(workers)] = {"study": study, "wall_seconds": wall, "pick": winner["policy"],
                                      "params": winner["params"]}
            print(f"{workers} worker(s): {wall:.1f} s, pick {winner['policy']}", file=sys.stderr, flush=True)
        per_round = _quality(args, replicas[0], loads[0][0], searches)
    finally:
        stop.set()
        for client, thread in loads:
            thread.join(30)
            client.close()
        for server, _ in servers:
            server.stop()
    result = summarise(args.replicas, args.trials, searches, per_round)
    (args.out / "fleet.json").write_text(json.dumps(result, indent=2))
    text = table(result)
    (args.out / "fleet.md").write_text(text)
    print(text)
    _plot(result, args.out / "fleet.png")
    return 0


def summarise(replicas: int, trials: int, searches: dict[str, dict], per_round: dict[str, list[float]]) -> dict:
    """The figures from the searches and the comparison's per-round seconds per token (grid names;
    a pick is measured under its grid name when it is a grid policy, else under its own label)."""
    means = {name: statistics.fmean(values) for name, values in per_round.items()}
    best = min((n for n in means if n in GRID), key=means.get)
    for search in searches.values():
        name = search["measured_as"]
        ratios = [v / b for v, b in zip(per_round[name], per_round[best], strict=True)]
        search["over_grid_best"] = means[name] / means[best]
        search["over_grid_best_per_round"] = ratios
    one, fleet = searches["1"]["wall_seconds"], searches[str(replicas)]["wall_seconds"]
    return {"replicas": replicas, "trials": trials, "searches": searches, "grid_best": best,
            "seconds_per_token": means, "seconds_per_token_per_round": per_round,
            "wall_fleet_over_one": fleet / one}


def table(result: dict) -> str:
    rows = ["| search | wall time (s) | pick | pick / grid best (per-round range) |", "|---|---|---|---|"]
    for workers, search in result["searches"].items():
        ratios = search["over_grid_best_per_round"]
        rows.append(f"| {workers} worker{'s' if workers != '1' else ''} | {search['wall_seconds']:.1f} | "
                    f"{search['pick']} | {search['over_grid_best']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    best = result["grid_best"]
    return "\n".join(rows) + (f"\n\ngrid best: {best} ({result['seconds_per_token'][best] * 1e3:.3f} ms/tok); "
                              f"wall time {result['replicas']} workers / 1 worker: "
                              f"{result['wall_fleet_over_one']:.2f}\n")


def _quality(args, replica, client, searches: dict[str, dict]) -> dict[str, list[float]]:
    """The grid and the picks, interleaved on one replica -> seconds per token of each round.
    Records under which name each search's pick was measured (`measured_as`)."""
    address, port = replica
    from otel.receiver import OtlpTraceReceiver

    info = client.model_info()
    collector = SpanCollector(request_sample, admit=SpanAdmission(info.instance_id).admit)
    space = SearchSpace.from_model_info(info)
    policies = dict(GRID)
    grid_names = {policy_key(p): name for name, p in GRID.items()}
    for workers, search in searches.items():
        pick = space.policy_from_params(search["params"], "")
        search["measured_as"] = grid_names.get(policy_key(pick), f"pick of {workers}")
        policies.setdefault(search["measured_as"], pick)
    measurer = Measurer(PolicyAdmin(client, address), collector,
                        MeasureConfig(WindowSpec(args.compare_tokens, args.compare_tokens // 8, 300.0),
                                      PruneRule(0.0), Objective.MEASURED, CostModel(info.expert_bytes)))
    with OtlpTraceReceiver("127.0.0.1", port, on_spans=collector.on_spans):
        compared = compare(measurer, policies, args.compare_rounds, f"bench-fleet-q{time.time_ns()}")
    return {c.name: c.per_round for c in compared}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    searches = result["searches"]
    left.bar([f"{k} worker(s)" for k in searches], [s["wall_seconds"] for s in searches.values()],
             color=["grey", "tab:blue"])
    left.set_ylabel("search wall time (s)")
    left.set_title(f"same budget: {result['trials']} trials")
    picked = {s["measured_as"] for s in searches.values()}
    names = list(result["seconds_per_token"])
    right.barh(names, [result["seconds_per_token"][n] * 1e3 for n in names],
               color=["tab:orange" if n in picked else "lightgrey" for n in names])
    right.set_xlabel("ms per committed token (interleaved, replica 0)")
    right.set_title("picks (orange) among the reference grid")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
