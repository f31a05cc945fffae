"""`moespec bench threads`: what `moespec serve` delivers over gRPC at each --threads count and with
no flag (the measured default, engine/threads.py), on this machine.

Each setting is its own `moespec serve` process, started in turn (an idle server's OpenMP threads
would still spin beside the one being measured), for `--rounds` rounds with the order reversed every
other round so drift on a shared machine hits every setting alike. Each round sends the same greedy
workload one request at a time (a single stream: the case a thread default is for) and counts
completion tokens per wall second at the client. Prints median [min, max] per setting; writes
threads.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from service.bench.server import load_workload
from service.server.client import MoespecClient

SERVE = (sys.executable, "-m", "service.cli", "serve", "--port", "0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=6, help="shipped held-out prompts per round")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="reports/bench", help="folder for threads.json")


def settings(cores: int) -> list[str]:
    """'default' (no flag) and every --threads count from 1 to the machine's cores."""
    return ["default", *(str(t) for t in range(1, cores + 1))]


def serve_and_measure(setting: str, workload) -> tuple[float, str]:
    """Start a server with the setting, run the workload once warm, return (tokens/s, its pick line)."""
    args = [*SERVE] + ([] if setting == "default" else ["--threads", setting])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("moespec serving on "):
            raise RuntimeError(f"server ({setting}) did not start: {line!r} {proc.stderr.read()[-500:]}")
        with MoespecClient(line.split()[-1]) as client:
            client.wait_ready(timeout=120)
            client.generate(workload[0])  # warm-up: one-off allocations
            tokens, t0 = 0, time.perf_counter()
            for request in workload:
                tokens += client.generate(request).completion_tokens
            rate = tokens / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    pick = next((ln for ln in err.splitlines() if "intra-op threads" in ln), "")
    return rate, pick


def run(args: argparse.Namespace) -> int:
    from service.engine.threads import usable_cores
    from service.errors import UsageError

    if args.requests < 1 or args.max_new_tokens < 1 or args.rounds < 1:
        raise UsageError("--requests, --max-new-tokens and --rounds must be >= 1")
    workload = load_workload(args.requests, args.max_new_tokens)
    cores = usable_cores()
    names = settings(cores)
    rates: dict[str, list[float]] = {s: [] for s in names}
    picks: set[str] = set()
    for r in range(args.rounds):
        for setting in names if r % 2 == 0 else reversed(names):
            rate, pick = serve_and_measure(setting, workload)
            rates[setting].append(rate)
            if setting == "default":
                picks.add(pick)
    summary = {
        "cores": cores, "rounds": args.rounds, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
        "default_pick": sorted(picks),
        "tokens_per_second": {s: {"median": round(statistics.median(v), 1), "min": round(min(v), 1),
                                  "max": round(max(v), 1), "rounds": [round(x, 1) for x in v]}
                              for s, v in rates.items()},
    }
    print(f"moespec serve over gRPC, one stream, {args.requests} requests x {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds ({cores} usable cores); default picked: {'; '.join(sorted(picks))}")
    print("| --threads | tokens/s median [min, max] |\n|---|---:|")
    for s, v in summary["tokens_per_second"].items():
        print(f"| {'(none: measured default)' if s == 'default' else s} | {v['median']} [{v['min']}, {v['max']}] |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "threads.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'threads.json'}")
    return 0
