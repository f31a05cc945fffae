"""Benchmark of the gRPC server: overhead against the in-process engine, load at concurrency N, and
speculation under continuous batching.

    python -m service.bench.server [--requests 8] [--max-new-tokens 32] [--concurrency 1 4 16 32]
    (or from `moespec bench server`: `add_arguments(parser)` + `run(args)`, or `bench_server(...)`)

1. Overhead: the same workload (the shipped held-out prompts, greedy, fixed policy) runs one request
   at a time in-process on an Engine and through a `moespec serve` child process over loopback gRPC,
   alternating request by request for `--rounds` rounds so drift on a shared machine hits both alike. Overhead =
   1 - (gRPC tokens/s) / (in-process tokens/s), from the medians over rounds; the per-request
   transport cost (client wall time - server-side generation time) is reported beside it.
2. Load: closed-loop clients at each concurrency send `max(requests, 2 * C)` requests, through
   `moespec serve` with its defaults (only the policy and --threads, if given, are set); the
   concurrencies run interleaved for `--load-rounds` rounds. Throughput (tokens/s: median and
   min..max over rounds; the ratio to concurrency 1 per round) and client-observed latency p50 / p99
   (pooled over rounds). The engine batches concurrent requests into one verify pass.
3. Policies under batching (`service.bench.batching`, in-process on an Engine with the server's
   default configuration, its measured thread count included, skipped with `--grid-rounds 0`): ms per
   committed token and the batch union
   of experts per layer for plain, n-gram k=2/4/8 and model k=1..4 (T=0) at concurrency 1/4/16.
The server runs as its own process (as deployed), so client and server never share a GIL. With
`--out DIR` the figures go to DIR/server-bench.json, .md (the tables) and .png (the plots).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from service.bench.batching import Cell, bench_policies, format_table, uniform_union
from service.server.client import MoespecClient
from service.types import DraftPolicy, GenerationRequest, SamplingParams

PROMPTS = Path(__file__).resolve().parent.parent / "prompts" / "heldout.jsonl"
SERVE = (sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", "serve")


@dataclass(frozen=True)
class Overhead:
    inprocess_tokens_per_s: float
    grpc_tokens_per_s: float
    overhead: float  # 1 - grpc / in-process
    transport_ms_per_request: float  # median of client wall time - server-side generation time
    rounds: int


@dataclass(frozen=True)
class Load:
    concurrency: int
    requests: int  # per round
    tokens_per_s: float  # median over rounds
    tokens_per_s_min: float
    tokens_per_s_max: float
    speedup_vs_1: float  # median over rounds of tokens/s here / tokens/s at the lowest concurrency, same round
    requests_per_s: float  # median over rounds
    p50_ms: float  # latencies pooled over rounds
    p99_ms: float
    rounds: int


def load_workload(count: int, max_new_tokens: int) -> list[GenerationRequest]:
    lines = PROMPTS.read_text().splitlines()[:count]
    # The last 400 characters keep prefill short and equal for both paths; greedy makes them comparable.
    return [
        GenerationRequest(prompt=json.loads(line)["prompt"][-400:], max_new_tokens=max_new_tokens,
                          sampling=SamplingParams(temperature=0.0))
        for line in lines
    ]


def bench_server(
    requests: int = 8,
    max_new_tokens: int = 32,
    concurrency: tuple[int, ...] = (1, 4, 16, 32),
    rounds: int = 3,
    threads: int | None = None,
    policy: DraftPolicy | None = None,
    load_rounds: int = 3,
    grid_rounds: int = 2,
    grid_concurrency: tuple[int, ...] = (1, 4, 16),
) -> tuple[Overhead, list[Load], list[Cell]]:
    """The same policy on both paths: plain decoding by default."""
    from service.engine import Engine, EngineConfig  # torch only when benchmarking
    from service.engine.threads import default_threads  # the server's own thread default, measured the same way

    policy = policy or DraftPolicy(policy_id="bench")
    workload = load_workload(requests, max_new_tokens)
    # The in-process side runs what the server runs: without --threads, the thread count the server picks
    # (torch's own default, all cores, is another configuration and was up to 2x off on a loaded machine).
    engine = Engine(EngineConfig(threads=threads or default_threads()))
    server_args = ["--port", "0", "--max-queue", str(max(concurrency) * 2), "--drafter", policy.drafter.value,
                   "--draft-length", str(policy.draft_length), "--draft-temperature", str(policy.draft_temperature)]
    if threads:
        server_args += ["--threads", str(threads)]
    with ServeProcess(server_args) as address, MoespecClient(address) as client:
        client.wait_ready(timeout=120)
        for r in workload[:2]:  # warm both paths: first calls pay one-off allocation costs
            engine.generate(r, policy)
            client.generate(r)
        local_tps, remote_tps, transport = [], [], []
        for _ in range(rounds):
            # Alternate request by request, so load from anything else on the machine hits both paths alike.
            local_s = remote_s = 0.0
            local_n = remote_n = 0
            for r in workload:
                t0 = time.perf_counter()
                local_n += engine.generate(r, policy).completion_tokens
                t1 = time.perf_counter()
                remote_n += _timed_remote(client, r, transport)
                local_s, remote_s = local_s + t1 - t0, remote_s + time.perf_counter() - t1
            local_tps.append(local_n / local_s)
            remote_tps.append(remote_n / remote_s)
        local, remote = statistics.median(local_tps), statistics.median(remote_tps)
        overhead = Overhead(local, remote, 1 - remote / local, 1000 * statistics.median(transport), rounds)
        loads = _loads(client, workload, concurrency, requests, load_rounds)
    # The server is gone: the grid has the machine to itself, like the load section had.
    cells = bench_policies(engine, workload, grid_concurrency, grid_rounds) if grid_rounds else []
    engine.close()
    return overhead, loads, cells


def format_report(overhead: Overhead, loads: list[Load], cells: list[Cell] = ()) -> str:
    lines = [
        f"gRPC overhead vs in-process engine (median of {overhead.rounds} alternating rounds, concurrency 1):",
        f"  in-process {overhead.inprocess_tokens_per_s:8.1f} tokens/s",
        f"  gRPC       {overhead.grpc_tokens_per_s:8.1f} tokens/s   overhead {100 * overhead.overhead:+.1f}% "
        f"(target <= 5%); transport {overhead.transport_ms_per_request:.2f} ms/request",
        "",
        f"Load through gRPC, server defaults ({loads[0].rounds if loads else 0} interleaved rounds):",
        "",
        "| concurrency | requests / round | tokens/s (min..max) | x concurrency 1 | requests/s | p50 ms | p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {x.concurrency} | {x.requests} | {x.tokens_per_s:.1f} "
        f"({x.tokens_per_s_min:.1f}..{x.tokens_per_s_max:.1f}) | {x.speedup_vs_1:.2f} | {x.requests_per_s:.2f} | "
        f"{x.p50_ms:.0f} | {x.p99_ms:.0f} |"
        for x in loads
    ]
    if cells:
        lines += ["", f"Policies under continuous batching (in-process, {cells[0].rounds} interleaved rounds):", "",
                  format_table(cells)]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=8, help="held-out prompts in the workload")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved in-process / gRPC rounds")
    parser.add_argument("--load-rounds", type=int, default=3, help="interleaved rounds over the concurrencies")
    parser.add_argument("--grid-rounds", type=int, default=2,
                        help="interleaved rounds of the policy x concurrency grid (0 skips it)")
    parser.add_argument("--grid-concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, both paths (default: the server's own default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for server-bench.json, server-bench.md and server-bench.png")


def run(args: argparse.Namespace) -> int:
    from service.errors import UsageError

    if (min(args.requests, args.max_new_tokens, args.rounds, args.load_rounds, *args.concurrency,
            *args.grid_concurrency) < 1 or args.grid_rounds < 0):
        raise UsageError("--requests, --max-new-tokens, --rounds, --load-rounds and the concurrencies must be >= 1, "
                         "--grid-rounds >= 0")
    overhead, loads, cells = bench_server(args.requests, args.max_new_tokens, tuple(args.concurrency), args.rounds,
                                          args.threads, load_rounds=args.load_rounds, grid_rounds=args.grid_rounds,
                                          grid_concurrency=tuple(args.grid_concurrency))
    report = format_report(overhead, loads, cells)
    print(report)
    figures = json.dumps({"overhead": asdict(overhead), "load": [asdict(x) for x in loads],
                          "policies": [asdict(x) for x in cells]}, indent=2)
    if args.json:
        args.json.write_text(figures)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "server-bench.json").write_text(figures)
        (args.out / "server-bench.md").write_text(report + "\n")
        plot(loads, cells, args.out / "server-bench.png")
        print(f"wrote {args.out}/server-bench.json, .md and .png")
    return 0


def plot(loads: list[Load], cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    conc = [x.concurrency for x in loads]
    ax.errorbar(conc, [x.tokens_per_s for x in loads],
                yerr=[[x.tokens_per_s - x.tokens_per_s_min for x in loads],
                      [x.tokens_per_s_max - x.tokens_per_s for x in loads]], marker="o", capsize=3, label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients (gRPC, server defaults)")
    ax.set_ylabel("tokens/s (median, min..max over rounds)")
    twin = ax.twinx()
    twin.plot(conc, [x.p99_ms for x in loads], "s--", color="tab:red", label="p99 latency")
    twin.set_ylabel("p99 latency (ms)", color="tab:red")
    ax.set_title("Throughput and p99 latency")
    if cells:
        ax = axes[1]
        for policy in dict.fromkeys(c.policy for c in cells):
            row = [c for c in cells if c.policy == policy]
            ax.plot([c.concurrency for c in row], [c.ms_per_committed_token for c in row], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (in-process)")
        ax.set_ylabel("ms per committed token (wall / tokens)")
        ax.set_title("Does speculation pay under batching?")
        ax.legend(fontsize=8)
        ax = axes[2]
        layers = len(cells[0].batch_unique_experts)
        for layer in range(layers):
            ax.scatter([c.mean_positions for c in cells], [c.batch_unique_experts[layer] for c in cells], s=14,
                       label=f"layer {layer}")
        top = max(c.mean_positions for c in cells)
        xs = [1 + i * (top - 1) / 200 for i in range(201)]
        experts = max(max(c.batch_unique_experts) for c in cells)
        info = _union_info(cells)
        if info:
            ax.plot(xs, [uniform_union(*info, x) for x in xs], "k--", label="uniform routing")
        ax.set_xscale("log")
        ax.set_xlabel("positions per pass (concurrency x window)")
        ax.set_ylabel("batch union: distinct routed experts")
        ax.set_ylim(0, max(experts, info[0] if info else experts) * 1.05)
        ax.set_title("Batch union per layer vs positions per pass")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _union_info(cells: list[Cell]) -> tuple[int, int] | None:
    """(E, m) recovered from a cell's uniform figure: the cells carry it, the plot needs no engine."""
    from service.engine.model.config import ModelConfig
    from service.engine.model.weights import DEFAULT_TARGET_DIR

    cfg = ModelConfig.from_json(DEFAULT_TARGET_DIR / "config.json")
    return (cfg.num_experts, cfg.num_experts_per_tok) if cfg.is_moe else None


# -- measurement helpers -------------------------------------------------------------------------


def _timed_remote(client: MoespecClient, request: GenerationRequest, transport: list[float]) -> int:
    t0 = time.perf_counter()
    reply = client.generate(request)
    transport.append(time.perf_counter() - t0 - reply.seconds)
    return reply.completion_tokens


def _loads(client: MoespecClient, workload: list[GenerationRequest], concurrency: tuple[int, ...], requests: int,
           rounds: int) -> list[Load]:
    runs: dict[int, list[tuple[float, int, list[float]]]] = {c: [] for c in concurrency}
    for _ in range(rounds):
        for c in concurrency:
            runs[c].append(load_round(client, workload, c, max(requests, 2 * c)))
    base = runs[concurrency[0]]
    loads = []
    for c in concurrency:
        tps = [tokens / wall for wall, tokens, _ in runs[c]]
        base_tps = [tokens / wall for wall, tokens, _ in base]
        latencies = sorted(lat for _, _, lats in runs[c] for lat in lats)
        total = max(requests, 2 * c)
        loads.append(Load(
            concurrency=c, requests=total, tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps),
            tokens_per_s_max=max(tps),
            speedup_vs_1=statistics.median(t / b for t, b in zip(tps, base_tps, strict=True)),
            requests_per_s=statistics.median(total / wall for wall, _, _ in runs[c]),
            p50_ms=1000 * _percentile(latencies, 0.50), p99_ms=1000 * _percentile(latencies, 0.99), rounds=rounds))
    return loads


def load_round(client: MoespecClient, workload: list[GenerationRequest], concurrency: int,
               total: int) -> tuple[float, int, list[float]]:
    """One closed-loop run -> (wall seconds, tokens, per-request latencies)."""
    jobs = [workload[i % len(workload)] for i in range(total)]

    def one(request: GenerationRequest) -> tuple[float, int]:
        t0 = time.perf_counter()
        reply = client.generate(request)
        return time.perf_counter() - t0, reply.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    return wall, sum(n for _, n in results), [lat for lat, _ in results]


def _percentile(sorted_values: list[float], q: float) -> float:
    # Nearest rank: with few samples p99 is the slowest request, which is what it should say.
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def stop_child(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a benchmark's child server; SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServeProcess:
    """`moespec serve` as a child; entering yields its address, leaving sends SIGTERM."""

    def __init__(self, args: list[str]):
        self._args = args

    def __enter__(self) -> str:
        self.proc = subprocess.Popen([*SERVE, *self._args], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("moespec serving on "):
            self.proc.kill()
            raise RuntimeError(f"server did not start (exit {self.proc.wait()}): {line!r}")
        return line.split()[-1]

    def __exit__(self, *exc) -> None:
        stop_child(self.proc)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m service.bench.server", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
