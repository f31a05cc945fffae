"""`moespec bench kernel-window`: batched passes with the fused MoE kernel up to 16 positions (the
grouped torch path above) vs every pass (the default), and the default with attention left eager,
side by side.

Three in-process engines at the thread count `moespec serve` picks on this machine (measured once,
printed), each with the default kernel threads: `kernel_window_max` 16, the default (KERNEL_WINDOW_MAX,
fused attention) and the default with `fused_attention=False`. Per round and policy, `--clients`
concurrent greedy requests on each engine, the order rotated every round so machine drift hits all
alike. Prints tokens/s per side, the
default's per-round ratio over each other side (median and range) and whether the outputs agree;
writes kernel-window.json to --out.
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
    from service.engine import Engine, EngineConfig
    from service.engine.model.layers import UNION_WINDOW_MAX
    from service.engine.threads import default_threads  # torch only when the benchmark really runs

    requests = load_workload(args.clients, args.max_new_tokens)  # greedy shipped prompts
    threads = default_threads()  # what a server started without --threads would use
    configs = {f"kernel<={UNION_WINDOW_MAX}": dict(kernel_window_max=UNION_WINDOW_MAX),
               "default, eager attention": dict(fused_attention=False),
               "default": {}}  # KERNEL_WINDOW_MAX, fused attention
    sides = {name: Engine(EngineConfig(threads=threads, **overrides)) for name, overrides in configs.items()}
    report = []
    try:
        for policy in POLICIES:
            rates: dict[str, list[float]] = {name: [] for name in sides}
            outputs: dict[str, list] = {}
            for r in range(args.rounds):
                order = list(sides)
                for name in order[r % len(order):] + order[:r % len(order)]:
                    rate, ids = concurrent_tokens_per_second(sides[name], requests, policy)
                    rates[name].append(rate)
                    outputs.setdefault(name, ids)
            row = {"policy": policy.policy_id, "clients": args.clients, "tokens_per_second": rates, "vs": {}}
            line = [f"{policy.policy_id:9s}"]
            line += [f"{name}: {statistics.median(v):5.0f} tok/s" for name, v in rates.items()]
            for name in sides:
                if name == "default":
                    continue
                ratios = [b / a for a, b in zip(rates[name], rates["default"], strict=True)]
                same = sum(a == b for a, b in zip(outputs[name], outputs["default"], strict=True))
                row["vs"][name] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                                   "ratio_max": max(ratios), "same_outputs": same}
                line.append(f"default / {name} {statistics.median(ratios):.2f} [{min(ratios):.2f}, "
                            f"{max(ratios):.2f}], same outputs {same}/{len(requests)}")
            report.append(row)
            print("  ".join(line), flush=True)
    finally:
        for engine in sides.values():
            engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel-window.json").write_text(json.dumps(report, indent=2))
    return 0
