"""Throughput with telemetry off, on with a live OTLP receiver, and on with an unreachable endpoint.

    python -m service.bench.telemetry [--cycles 3] [--block 4] [--max-new-tokens 32] [--draft-length 3]
    moespec bench telemetry [same options]   (service/bench/__init__.py dispatches to add_arguments / run)
    run_benchmark(backend, ...) -> [ModeResult]; format_report(results) -> str   (library use)

Method: the same greedy requests (identical work) run in blocks, one telemetry mode per block, the
mode order rotating each cycle so drift on a shared machine hits every mode alike. Each mode has one
Telemetry for the whole run (the real OTLP/gRPC exporters, the bounded span processor, metrics
exported every 10 s as in deploy/); every block ends with a flush so its export work is its own.
Throughput = completion tokens / wall seconds of the observed requests (telemetry calls included).
Worst case on purpose: every verify step gets a span (ratio 1 by default), spans are batched every
200 ms (the tuner's setting). The live receiver is
`python -m otel.receiver` in its own process, as a collector would be (on a small machine it still
competes for the same cores). "Unreachable" is a loopback port nothing listens on.
Targets: live >= 98% and unreachable >= 95% of off.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

from otel.api import NoTelemetry
from otel.config import DEFAULT_VERIFY_SPAN_RATIO, TelemetryConfig
from otel.setup import build_telemetry_from_config
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

MODES = ("off", "live", "unreachable")
REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = MappingProxyType({"live": 0.98, "unreachable": 0.95})
BENCH_POLICY = DraftPolicy(Drafter.MODEL, 3, policy_id="bench")  # frozen dataclass: safe to share
DEFAULT_PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(path):\n",
                   "def parse_args(argv):\n", "for i in range(10):\n", "def merge(a, b):\n")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_second: float
    relative: float  # tokens_per_second / off's
    relative_median: float  # median over cycles of (this mode's / off's throughput in the same cycle)
    relative_min: float  # the spread of those per-cycle ratios: lowest ...
    relative_max: float  # ... and highest
    cpu_ms_per_token: float  # this process's CPU time (all threads, export included) per token
    cpu_overhead: float  # cpu_ms_per_token / off's - 1
    spans_exported: int
    spans_dropped: int


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ReceiverProcess:
    process: subprocess.Popen
    address: str

    def stop(self) -> None:
        self.process.stdin.close()  # the receiver exits when its stdin closes
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_receiver_process() -> ReceiverProcess:
    process = subprocess.Popen([sys.executable, "-m", "otel.receiver", "--port", "0"], cwd=REPO_ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("otlp receiver on "):
        process.kill()
        raise RuntimeError(f"the OTLP receiver did not start: {line!r}")
    return ReceiverProcess(process, line.split()[-1])


def mode_environ(mode: str, endpoint: str, verify_span_ratio: float) -> dict[str, str]:
    if mode == "off":
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "10000", "MOESPEC_VERIFY_SPAN_RATIO": str(verify_span_ratio)}


def run_benchmark(
    backend,
    *,
    cycles: int = 3,
    block: int = 4,
    max_new_tokens: int = 32,
    policy: DraftPolicy = BENCH_POLICY,
    verify_span_ratio: float = DEFAULT_VERIFY_SPAN_RATIO,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    log: Callable[[str], None] | None = None,
) -> list[ModeResult]:
    """`backend`: anything with `.info` and `.generate(request, policy)` (the engine, a Backend)."""
    requests = [GenerationRequest(prompt=p, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0))
                for p in prompts]
    totals = {m: {"requests": 0, "tokens": 0, "seconds": 0.0, "cpu": 0.0, "exported": 0, "dropped": 0} for m in MODES}
    per_cycle: list[dict[str, float]] = []  # tok/s of each mode within one cycle
    receiver = start_receiver_process()
    endpoints = {"off": "", "live": f"http://{receiver.address}", "unreachable": f"http://127.0.0.1:{closed_port()}"}
    # One Telemetry per mode for the whole run, as in a long-running server (channels, threads and
    # instruments are set up once); each block ends with a flush, so its export work is its own.
    telemetries = {}
    try:
        for mode in MODES:
            config = TelemetryConfig.from_environ(mode_environ(mode, endpoints[mode], verify_span_ratio))
            telemetries[mode] = build_telemetry_from_config(config, backend.info) if config.enabled else NoTelemetry()
        backend.generate(requests[0], policy)  # warm-up, unmeasured
        for cycle in range(cycles):
            order = MODES[cycle % len(MODES):] + MODES[:cycle % len(MODES)]
            per_cycle.append({})
            for mode in order:
                telemetry, t = telemetries[mode], totals[mode]
                block_tokens, block_seconds, cpu0 = 0, 0.0, time.process_time()
                for i in range(block):
                    request = requests[(cycle * block + i) % len(requests)]
                    t0 = time.perf_counter()
                    with telemetry.request(backend.info, request, policy) as obs:
                        result = backend.generate(request, policy)
                        obs.finish(result)
                    block_seconds += time.perf_counter() - t0
                    block_tokens += result.completion_tokens
                telemetry.force_flush(2000)
                # CPU time, unlike wall time, is not inflated by other processes on a shared machine;
                # it includes the export threads and the flush of this block's spans.
                t["cpu"] += time.process_time() - cpu0
                t["seconds"] += block_seconds
                t["tokens"] += block_tokens
                t["requests"] += block
                per_cycle[-1][mode] = block_tokens / block_seconds
                if log:
                    log(f"cycle {cycle + 1}/{cycles} {mode:<11} {t['tokens'] / t['seconds']:8.1f} tok/s so far")
        for mode, telemetry in telemetries.items():
            totals[mode]["exported"] = sum(s.exported for s in getattr(telemetry, "export_stats", ()))
            totals[mode]["dropped"] = telemetry.dropped_spans
    finally:
        for telemetry in telemetries.values():
            telemetry.shutdown()
        receiver.stop()
    off = totals["off"]["tokens"] / totals["off"]["seconds"]
    off_cpu = totals["off"]["cpu"] / totals["off"]["tokens"]
    ratios = {m: [c[m] / c["off"] for c in per_cycle] for m in totals}
    return [ModeResult(m, t["requests"], t["tokens"], t["seconds"], t["tokens"] / t["seconds"],
                       (t["tokens"] / t["seconds"]) / off, statistics.median(ratios[m]), min(ratios[m]), max(ratios[m]),
                       1000 * t["cpu"] / t["tokens"], (t["cpu"] / t["tokens"]) / off_cpu - 1,
                       t["exported"], t["dropped"]) for m, t in totals.items()]


def format_report(results: Sequence[ModeResult]) -> str:
    """`vs off`: total throughput ratio; `cycle med`: median of the per-cycle ratios (robust to one
    disturbed block); `cycle range`: their lowest and highest (the spread over repeats); `cpu +`: extra
    CPU time per token (the least noisy figure on a shared machine). The verdict uses the total
    throughput ratio."""
    lines = [f"{'telemetry':<12}{'requests':>9}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs off':>8}{'cycle med':>10}"
             f"{'cycle range':>15}{'cpu ms/tok':>11}{'cpu +':>7}{'spans exported':>16}{'dropped':>9}  target"]
    for r in results:
        target = TARGETS.get(r.mode)
        verdict = "" if target is None else f">= {target:.0%} {'ok' if r.relative >= target else 'MISSED'}"
        spread = f"{r.relative_min:.1%}-{r.relative_max:.1%}"
        lines.append(f"{r.mode:<12}{r.requests:>9}{r.tokens:>8}{r.seconds:>9.2f}{r.tokens_per_second:>9.1f}"
                     f"{r.relative:>8.1%}{r.relative_median:>10.1%}{spread:>15}{r.cpu_ms_per_token:>11.2f}"
                     f"{r.cpu_overhead:>7.1%}"
                     f"{r.spans_exported:>16}{r.spans_dropped:>9}  {verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`moespec bench telemetry` options (also `python -m service.bench.telemetry`)."""
    parser.add_argument("--cycles", type=int, default=3, help="rounds over the three modes (default 3)")
    parser.add_argument("--block", type=int, default=4, help="requests per mode per cycle (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--draft-length", type=int, default=3, help="model drafter's k (default 3)")
    parser.add_argument("--verify-span-ratio", type=float, default=DEFAULT_VERIFY_SPAN_RATIO,
                        help=f"share of verify steps with a span (default {DEFAULT_VERIFY_SPAN_RATIO}, the "
                             "server's; 1 is the worst case)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from service.engine import Engine, EngineConfig  # torch only when the benchmark really runs
    from service.errors import UsageError

    if args.cycles < 1 or args.block < 1 or args.max_new_tokens < 1 or not 0 <= args.verify_span_ratio <= 1:
        raise UsageError("--cycles, --block and --max-new-tokens must be >= 1; --verify-span-ratio in [0, 1]")
    engine = Engine(EngineConfig(threads=args.threads))
    results = run_benchmark(engine, cycles=args.cycles, block=args.block, max_new_tokens=args.max_new_tokens,
                            policy=DraftPolicy(Drafter.MODEL, args.draft_length, policy_id="bench"),
                            verify_span_ratio=args.verify_span_ratio, log=print)
    print(format_report(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.bench.telemetry", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
