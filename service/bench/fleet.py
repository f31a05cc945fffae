"""`moespec bench fleet`: one `moespec tune` worker vs N workers (one per replica) on the same trial
budget, each search in its own study of one PostgreSQL (--storage), and the picks' quality.

1. N replicas on loopback (`moespec serve`, one torch thread and one kernel thread each, so the
   cores are shared alike), each with its own closed-loop load generator for the whole run.
2. One worker on replica 0, --trials search trials: wall time until it exits.
3. N workers, one per replica, the same --trials for the whole fleet: wall time until all exit.
4. Afterwards, on replica 0 alone: a fixed reference grid (plain, n-gram k=1..4, model k=1..3 at
   T=0) and both picks, measured interleaved in --compare-rounds rounds (order rotated); a pick's
   quality is its cost over the grid best's (target: N workers within 5% in <= 0.5x the wall time).
Writes fleet.json, fleet.md and fleet.png to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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
from tuner.loop.space import SearchSpace
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
        **{f"ngram k={k}": DraftPolicy(Drafter.NGRAM, k, 1.0) for k in (1, 2, 3, 4)},
        **{f"model k={k} T=0": DraftPolicy(Drafter.MODEL, k, 0.0) for k in (1, 2, 3)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", required=True, help="PostgreSQL URL (postgresql+psycopg2://...) for the studies")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--trials", type=int, default=8, help="search trials, for one worker and for the fleet")
    parser.add_argument("--min-tokens", type=int, default=96)
    parser.add_argument("--min-steps", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--compare-rounds", type=int, default=2)
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
               "--study", study, "--trials", str(args.trials), "--remeasure", "1", "--tuner-id", f"w{i}",
               "--seed", str(args.seed + i), "--trial-mode", "sequential", "--min-tokens", str(args.min_tokens),
               "--min-steps", str(args.min_steps), "--admin-token", TOKEN]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "MOESPEC_ADMIN_TOKEN": ""}))
    errors = [p.communicate()[1] for p in procs]
    wall = time.monotonic() - start
    for p, err in zip(procs, errors, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a worker exited {p.returncode}:\n{err[-3000:]}")
    return wall, optuna.load_study(study_name=study, storage=args.storage).user_attrs["winner"]


def run(args: argparse.Namespace) -> int:
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
        wall_one, pick_one = _search(args, replicas, f"bench-fleet-1-{tag}", 1)
        print(f"1 worker: {wall_one:.1f} s, pick {pick_one['policy']}", file=sys.stderr, flush=True)
        wall_n, pick_n = _search(args, replicas, f"bench-fleet-{args.replicas}-{tag}", args.replicas)
        print(f"{args.replicas} workers: {wall_n:.1f} s, pick {pick_n['policy']}", file=sys.stderr, flush=True)
        rows = _quality(args, replicas[0], loads[0][0], {"1 worker": pick_one, f"{args.replicas} workers": pick_n})
    finally:
        stop.set()
        for client, thread in loads:
            thread.join(30)
            client.close()
        for server, _ in servers:
            server.stop()
    best = min(v for k, v in rows.items() if k in GRID)
    result = {"replicas": args.replicas, "trials": args.trials,
              "wall_seconds": {"1": wall_one, str(args.replicas): wall_n},
              "picks": {"1": pick_one["policy"], str(args.replicas): pick_n["policy"]},
              "seconds_per_token": rows, "grid_best": min((k for k in rows if k in GRID), key=rows.get),
              "pick_over_grid_best": {k: rows[k] / best for k in rows if k not in GRID},
              "speedup": wall_one / wall_n}
    (args.out / "fleet.json").write_text(json.dumps(result, indent=2))
    table = ["| search | wall time (s) | pick | pick / grid best |", "|---|---|---|---|"]
    for key, label in (("1", "1 worker"), (str(args.replicas), f"{args.replicas} workers")):
        table.append(f"| {label} | {result['wall_seconds'][key]:.1f} | {result['picks'][key]} | "
                     f"{result['pick_over_grid_best'][label]:.3f} |")
    text = "\n".join(table) + (f"\n\ngrid best: {result['grid_best']} ({best * 1e3:.3f} ms/tok); "
                               f"wall time {args.replicas} workers / 1 worker: {wall_n / wall_one:.2f}\n")
    (args.out / "fleet.md").write_text(text)
    print(text)
    _plot(result, rows, args.out / "fleet.png")
    return 0


def _quality(args, replica, client, picks: dict[str, dict]) -> dict[str, float]:
    address, port = replica
    from otel.receiver import OtlpTraceReceiver

    admission = SpanAdmission(client.model_info().instance_id)
    collector = SpanCollector(request_sample, admit=admission.admit)
    info = client.model_info()
    space = SearchSpace.from_model_info(info)
    policies = dict(GRID)
    for label, pick in picks.items():
        policies[label] = space.policy_from_params(pick["params"], "")
    measurer = Measurer(PolicyAdmin(client, address), collector,
                        MeasureConfig(WindowSpec(args.min_tokens * 2, args.min_steps * 2, 120.0), PruneRule(0.0),
                                      Objective.MEASURED, CostModel(info.expert_bytes)))
    with OtlpTraceReceiver("127.0.0.1", port, on_spans=collector.on_spans):
        compared = compare(measurer, policies, args.compare_rounds, f"bench-fleet-q{time.time_ns()}")
    return {c.name: c.stats.seconds_per_token for c in compared}


def _plot(result: dict, rows: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    walls = result["wall_seconds"]
    left.bar([f"{k} worker(s)" for k in walls], list(walls.values()), color=["grey", "tab:blue"])
    left.set_ylabel("search wall time (s)")
    left.set_title(f"same budget: {result['trials']} trials")
    names = list(rows)
    right.barh(names, [rows[n] * 1e3 for n in names],
               color=["tab:orange" if n not in GRID else "lightgrey" for n in names])
    right.set_xlabel("ms per committed token (interleaved, replica 0)")
    right.set_title("picks vs the reference grid")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
