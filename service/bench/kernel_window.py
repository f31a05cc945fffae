"""`moespec bench kernel-window`: batched passes with the fused MoE kernel up to 16 positions vs up to
KERNEL_WINDOW_MAX (the default), side by side.

Two in-process engines (`EngineConfig.kernel_window_max` 16 and the default) at the thread count
`moespec serve` picks on this machine (measured once, printed); per round and policy, `--clients`
concurrent greedy requests on each engine, the order reversed every other round so machine drift
hits both alike. Prints tokens/s per side, the per-round ratio (median and range) and whether the
outputs agree; writes kernel-window.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from service.bench.server import load_workload
from service.types import Drafter, DraftPolicy, GenerationRequest

POLICIES = (DraftPolicy(Drafter.MODEL, 0, 0.0, "plain"), DraftPolicy(Drafter.NGRAM, 4, 0.0, "ngram-k4"),
            DraftPolicy(Drafter.MODEL, 3, 0.0, "model-k3"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests per measurement")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="reports/bench", help="folder for kernel-window.json")


def concurrent_tokens_per_second(engine, requests: list[GenerationRequest], policy: DraftPolicy):
    """All requests at once -> (completion tokens per wall second, each request's token ids)."""
    results = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = engine.generate(requests[i], policy)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return sum(r.completion_tokens for r in results) / seconds, [r.token_ids for r in results]


def run(args: argparse.Namespace) -> int:
    from service.cli.serve import default_threads  # torch only when the benchmark really runs
    from service.engine import Engine, EngineConfig
    from service.engine.model import KERNEL_WINDOW_MAX, UNION_WINDOW_MAX

    requests = load_workload(args.clients, args.max_new_tokens)  # greedy shipped prompts
    threads = default_threads()  # what a server started without --threads would use
    sides = {limit: Engine(EngineConfig(threads=threads, kernel_window_max=limit))
             for limit in (UNION_WINDOW_MAX, KERNEL_WINDOW_MAX)}
    report = []
    try:
        for policy in POLICIES:
            rates: dict[int, list[float]] = {limit: [] for limit in sides}
            outputs: dict[int, list] = {}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for limit in order:
                    rate, ids = concurrent_tokens_per_second(sides[limit], requests, policy)
                    rates[limit].append(rate)
                    outputs.setdefault(limit, ids)
            ratios = [b / a for a, b in zip(rates[UNION_WINDOW_MAX], rates[KERNEL_WINDOW_MAX], strict=True)]
            same = sum(a == b for a, b in zip(outputs[UNION_WINDOW_MAX], outputs[KERNEL_WINDOW_MAX], strict=True))
            row = {"policy": policy.policy_id, "clients": args.clients,
                   "tokens_per_second": {str(k): v for k, v in rates.items()},
                   "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                   "same_outputs": same}
            report.append(row)
            narrow, wide = (statistics.median(rates[k]) for k in (UNION_WINDOW_MAX, KERNEL_WINDOW_MAX))
            print(f"{policy.policy_id:9s} kernel<={UNION_WINDOW_MAX}: {narrow:6.0f} tok/s  "
                  f"kernel<={KERNEL_WINDOW_MAX}: {wide:6.0f} tok/s  "
                  f"ratio {row['ratio_median']:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]  "
                  f"same outputs {same}/{len(requests)}", flush=True)
    finally:
        for engine in sides.values():
            engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel-window.json").write_text(json.dumps(report, indent=2))
    return 0
