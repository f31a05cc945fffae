"""Benchmark of the gRPC server: overhead against the in-process engine, and load at concurrency N.

    python -m service.bench.server [--requests 8] [--max-new-tokens 32] [--concurrency 1 4 16]
    (or from `moespec bench --server`: `add_arguments(parser)` + `run(args)`, or `bench_server(...)`)

1. Overhead: the same workload (the shipped held-out prompts, greedy, fixed policy) runs one request
   at a time in-process on an Engine and through a `moespec serve` child process over loopback gRPC,
   alternating request by request for `--rounds` rounds so drift on a shared machine hits both alike. Overhead =
   1 - (gRPC tokens/s) / (in-process tokens/s), from the medians over rounds; the per-request
   transport cost (client wall time - server-side generation time) is reported beside it.
2. Load: closed-loop clients at each concurrency send `max(requests, 2 * C)` requests; throughput
   (tokens/s, requests/s) and client-observed latency p50 / p99. The torch engine serves one request
   at a time, so concurrency above 1 queues: latency grows with C while throughput stays flat.
The server runs as its own process (as deployed), so client and server never share a GIL.
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
    requests: int
    tokens_per_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float


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
    concurrency: tuple[int, ...] = (1, 4, 16),
    rounds: int = 3,
    threads: int | None = None,
    policy: DraftPolicy | None = None,
) -> tuple[Overhead, list[Load]]:
    """The same policy on both paths: plain decoding by default."""
    from service.engine import Engine, EngineConfig  # torch only when benchmarking

    policy = policy or DraftPolicy(policy_id="bench")
    workload = load_workload(requests, max_new_tokens)
    engine = Engine(EngineConfig(threads=threads))
    server_args = ["--port", "0", "--max-queue", str(max(concurrency) * 2), "--drafter", policy.drafter.value,
                   "--draft-length", str(policy.draft_length), "--draft-temperature", str(policy.draft_temperature)]
    if threads:
        server_args += ["--threads", str(threads)]
    with _ServerProcess(server_args) as address, MoespecClient(address) as client:
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
        engine.close()
        local, remote = statistics.median(local_tps), statistics.median(remote_tps)
        overhead = Overhead(local, remote, 1 - remote / local, 1000 * statistics.median(transport), rounds)
        loads = [_load(client, workload, c, max(requests, 2 * c)) for c in concurrency]
    return overhead, loads


def format_report(overhead: Overhead, loads: list[Load]) -> str:
    lines = [
        f"gRPC overhead vs in-process engine (median of {overhead.rounds} alternating rounds, concurrency 1):",
        f"  in-process {overhead.inprocess_tokens_per_s:8.1f} tokens/s",
        f"  gRPC       {overhead.grpc_tokens_per_s:8.1f} tokens/s   overhead {100 * overhead.overhead:+.1f}% "
        f"(target <= 5%); transport {overhead.transport_ms_per_request:.2f} ms/request",
        "",
        "| concurrency | requests | tokens/s | requests/s | p50 ms | p99 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {x.concurrency} | {x.requests} | {x.tokens_per_s:.1f} | {x.requests_per_s:.2f} | {x.p50_ms:.0f} | "
        f"{x.p99_ms:.0f} |"
        for x in loads
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=8, help="held-out prompts in the workload")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved in-process / gRPC rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both paths")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from service.cli import UsageError

    if args.requests < 1 or args.max_new_tokens < 1 or args.rounds < 1 or min(args.concurrency) < 1:
        raise UsageError("--requests, --max-new-tokens, --rounds and --concurrency must be >= 1")
    overhead, loads = bench_server(args.requests, args.max_new_tokens, tuple(args.concurrency), args.rounds,
                                   args.threads)
    print(format_report(overhead, loads))
    if args.json:
        args.json.write_text(json.dumps({"overhead": asdict(overhead), "load": [asdict(x) for x in loads]}, indent=2))
    return 0


# -- measurement helpers -------------------------------------------------------------------------


def _timed_remote(client: MoespecClient, request: GenerationRequest, transport: list[float]) -> int:
    t0 = time.perf_counter()
    reply = client.generate(request)
    transport.append(time.perf_counter() - t0 - reply.seconds)
    return reply.completion_tokens


def _load(client: MoespecClient, workload: list[GenerationRequest], concurrency: int, total: int) -> Load:
    jobs = [workload[i % len(workload)] for i in range(total)]

    def one(request: GenerationRequest) -> tuple[float, int]:
        t0 = time.perf_counter()
        reply = client.generate(request)
        return time.perf_counter() - t0, reply.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    latencies = sorted(lat for lat, _ in results)
    return Load(
        concurrency=concurrency,
        requests=total,
        tokens_per_s=sum(n for _, n in results) / wall,
        requests_per_s=total / wall,
        p50_ms=1000 * _percentile(latencies, 0.50),
        p99_ms=1000 * _percentile(latencies, 0.99),
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    # Nearest rank: with few samples p99 is the slowest request, which is what it should say.
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


class _ServerProcess:
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
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m service.bench.server", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
