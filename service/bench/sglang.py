"""`moespec bench sglang`: the SGLang backend by policy, with the embedded engine beside it.

    ~/.cache/moespec/sglang-venv/bin/moespec bench sglang [--device cpu|cuda] [--prompts 2]
                         [--repeats 2] [--max-new-tokens 24] [--out reports/bench-sglang]

Run it with the moespec of an environment that has sglang (scripts/setup_sglang_cpu.sh builds one):
the server child runs with this same python.

One `moespec serve --backend sglang` child (the shipped pair, fp32 on CPU) is served through gRPC
and, for each policy (plain; NGRAM k = 2, 4, 8; STANDALONE k = 1..4), set through PolicyAdmin. The
first request after a change absorbs the engine swap and is not measured. Then, for every prompt
and repeat, one SGLang request and one embedded-engine request (in this process, same prompt, same
policy, greedy) run back to back, so drift on a shared machine hits both alike. Reported per policy
and backend: tokens/s (completion tokens / client wall time) and seconds per committed token (the
server's own figure), each as median and min-max over the runs, plus the mean per-layer unique
experts by window size (k + 1). JSON, a Markdown table (printed) and a PNG land in --out.

On --device cpu the child needs sgl-kernel's CPU ops: the test-support stand-in directory
(tests/sglang_cpu/site, default --stand-in) goes on the child's PYTHONPATH only; this process never
imports it. Figures taken that way are "CPU with stand-in kernels", not SGLang's real CPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

REPO = Path(__file__).resolve().parent.parent.parent
MODELS = REPO / "service" / "models"
STAND_IN = REPO / "tests" / "sglang_cpu" / "site"
POLICIES = (
    DraftPolicy(draft_length=0, policy_id="plain"),
    *(DraftPolicy(Drafter.NGRAM, k, policy_id=f"ngram-k{k}") for k in (2, 4, 8)),
    *(DraftPolicy(Drafter.MODEL, k, policy_id=f"standalone-k{k}") for k in (1, 2, 3, 4)),
)
TOKEN = "bench-sglang"


@dataclass(frozen=True)
class Row:
    policy_id: str
    backend: str  # "sglang" or "embedded"
    window: int  # k + 1
    runs: int
    tokens_per_s: float  # median over runs
    tokens_per_s_min: float
    tokens_per_s_max: float
    s_per_committed: float  # median over runs
    s_per_committed_min: float
    s_per_committed_max: float
    unique_experts_mean: tuple[float, ...]  # per layer, mean over the runs' steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where SGLang computes")
    parser.add_argument("--prompts", type=int, default=2, help="shipped held-out prompts per policy")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every prompt per policy and backend")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--stand-in", type=Path, default=STAND_IN,
                        help="directory put on the server's PYTHONPATH on --device cpu (sgl-kernel CPU ops)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-sglang"))


def run(args: argparse.Namespace) -> int:
    from service.errors import UsageError

    if args.prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise UsageError("--prompts, --repeats and --max-new-tokens must be >= 1")
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise UsageError("bench sglang needs sglang in this environment: run the moespec of the SGLang venv "
                         "(bash scripts/setup_sglang_cpu.sh builds ~/.cache/moespec/sglang-venv)")
    rows = bench(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sglang.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    table = markdown(rows, args)
    (args.out / "bench_sglang.md").write_text(table)
    plot(rows, args.out / "bench_sglang.png", args.device)
    print(table)
    print(f"wrote {args.out}/bench_sglang.json, .md, .png")
    return 0


def bench(args: argparse.Namespace) -> list[Row]:
    from service.bench.engine import load_prompts
    from service.engine import Engine, EngineConfig
    from service.server.client import MoespecClient
    from tuner.drivers.server_proc import start_server

    prompts = load_prompts(args.prompts)
    engine = Engine(EngineConfig(threads=1))
    server_args = ["--backend", "sglang", "--device", args.device, "--model-path", str(MODELS / "target"),
                   "--draft-model-path", str(MODELS / "draft"), "--sglang-arg", "dtype=float32",
                   "--otel-disabled"]
    env = {"PYTHONPATH": os.pathsep.join([str(args.stand_in), str(REPO)])} if args.device == "cpu" else {}
    server = start_server(env, TOKEN, tuple(server_args), ready_timeout=900)
    rows = []
    try:
        with MoespecClient(server.address, admin_token=TOKEN) as client:
            client.wait_ready(timeout=120)
            for policy in POLICIES:
                rows.extend(bench_policy(client, engine, policy, prompts, args.repeats, args.max_new_tokens))
                print(f"{policy.policy_id}: done", file=sys.stderr, flush=True)
    finally:
        server.stop(timeout=60)
        engine.close()
    return rows


def bench_policy(client, engine, policy: DraftPolicy, prompts: list[str], repeats: int, max_new: int) -> list[Row]:
    greedy = SamplingParams(temperature=0.0)
    client.set_policy(policy)
    client.generate(GenerationRequest(prompt=prompts[0], max_new_tokens=4, sampling=greedy), timeout=900)  # swap
    runs: dict[str, list[tuple[float, float, tuple[float, ...]]]] = {"sglang": [], "embedded": []}
    for _ in range(repeats):
        for prompt in prompts:
            request = GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=greedy)
            t0 = time.perf_counter()
            reply = client.generate(request, timeout=900)
            runs["sglang"].append((reply.completion_tokens / (time.perf_counter() - t0),
                                   reply.spec.seconds_per_committed_token, reply.spec.unique_experts_mean))
            t0 = time.perf_counter()
            result = engine.generate(request, policy)
            runs["embedded"].append((result.completion_tokens / (time.perf_counter() - t0),
                                     result.spec.seconds_per_committed_token, result.spec.unique_experts_mean))
    return [summarise(policy, backend, got) for backend, got in runs.items()]


def summarise(policy: DraftPolicy, backend: str, runs: list) -> Row:
    rates, costs, unions = zip(*runs, strict=True)
    layers = len(unions[0])
    return Row(policy.policy_id, backend, policy.draft_length + 1, len(runs),
               statistics.median(rates), min(rates), max(rates),
               statistics.median(costs), min(costs), max(costs),
               tuple(round(statistics.fmean(u[i] for u in unions), 2) for i in range(layers)))


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    label = "CPU with stand-in kernels" if args.device == "cpu" else "CUDA"
    lines = [f"SGLang ({label}) vs the embedded engine, greedy, {args.prompts} prompts x {args.repeats} repeats, "
             f"{args.max_new_tokens} new tokens; median [min-max] over runs",
             "",
             "| policy | window | backend | tokens/s | s / committed token | unique experts per layer (mean) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.policy_id} | {r.window} | {r.backend} | {r.tokens_per_s:.1f} "
                     f"[{r.tokens_per_s_min:.1f}-{r.tokens_per_s_max:.1f}] | {r.s_per_committed:.4f} "
                     f"[{r.s_per_committed_min:.4f}-{r.s_per_committed_max:.4f}] | "
                     f"{', '.join(f'{u:.1f}' for u in r.unique_experts_mean)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r.policy_id for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for offset, backend in ((-0.2, "sglang"), (0.2, "embedded")):
        mine = {r.policy_id: r for r in rows if r.backend == backend}
        xs = [i + offset for i in range(len(policies))]
        medians = [mine[p].tokens_per_s for p in policies]
        spread = [[mine[p].tokens_per_s - mine[p].tokens_per_s_min for p in policies],
                  [mine[p].tokens_per_s_max - mine[p].tokens_per_s for p in policies]]
        left.bar(xs, medians, width=0.4, yerr=spread, label=backend)
        windows = [mine[p].window for p in policies]
        right.scatter(windows, [statistics.fmean(mine[p].unique_experts_mean) for p in policies], label=backend)
    left.set_xticks(range(len(policies)), policies, rotation=30, ha="right")
    left.set_ylabel("tokens/s (median, min-max)")
    left.set_title(f"SGLang ({'CPU, stand-in kernels' if device == 'cpu' else 'CUDA'}) vs embedded")
    left.legend()
    right.set_xlabel("verify window (k + 1)")
    right.set_ylabel("unique routed experts per layer (mean)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
