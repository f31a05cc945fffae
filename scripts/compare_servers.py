"""Before / after for a server change: two `moespec serve` processes, one from another checkout of this
repository (`--before`, e.g. `git worktree add /tmp/before <commit>`) and one from this one, each
started with its defaults (this venv's Python, the checkout's own code), then the load of `moespec
bench server` (closed-loop gRPC clients, the shipped held-out prompts) on each in turn, interleaved
round by round with the order flipped every round, so machine drift hits both alike.

    python scripts/compare_servers.py --before /tmp/before [--concurrency 1 4 16 32] [--rounds 6]

Prints, per concurrency, tokens/s of each side (median and min..max over rounds) and the after /
before ratio per round (median and min..max); and each side's 16-clients-over-1 ratio per round when
both concurrencies ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def serve(checkout: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "0"], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("moespec serving on "):
        proc.kill()
        raise SystemExit(f"compare_servers: the server in {checkout} did not start (exit {proc.wait()}): {line!r}")
    return proc, line.split()[-1]


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="another checkout of this repository")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=8, help="held-out prompts in the workload")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if not (args.before / "service" / "cli").is_dir():
        raise SystemExit(f"compare_servers: {args.before} is not a checkout of this repository")
    if min(args.rounds, args.requests, args.max_new_tokens, *args.concurrency) < 1:
        raise SystemExit("compare_servers: --rounds, --requests, --max-new-tokens and --concurrency must be >= 1")

    sys.path.insert(0, str(HERE))
    from service.bench.server import load_round, load_workload
    from service.server.client import MoespecClient

    workload = load_workload(args.requests, args.max_new_tokens)
    sides = {"before": serve(args.before.resolve()), "after": serve(HERE)}
    clients = {name: MoespecClient(address) for name, (_, address) in sides.items()}
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for client in clients.values():
            client.wait_ready(timeout=120)
            for request in workload[:2]:  # warm both: first calls pay one-off costs
                client.generate(request)
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for c in args.concurrency:
                for name in order:
                    wall, tokens, _ = load_round(clients[name], workload, c, max(args.requests, 2 * c))
                    rates.setdefault((name, c), []).append(tokens / wall)
    finally:
        for client in clients.values():
            client.close()
        for proc, _ in sides.values():
            proc.terminate()
            proc.wait(30)
    print(f"| clients | before tokens/s | after tokens/s | after / before per round ({args.rounds} rounds) |")
    print("|---:|---:|---:|---:|")
    for c in args.concurrency:
        before, after = rates[("before", c)], rates[("after", c)]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        print(f"| {c} | {spread(before)} | {spread(after)} | {spread(ratios, 2)} |")
    if 1 in args.concurrency and 16 in args.concurrency:
        for name in clients:
            ratios = [a / b for a, b in zip(rates[(name, 16)], rates[(name, 1)], strict=True)]
            print(f"{name}: 16 clients / 1 client per round {spread(ratios, 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
