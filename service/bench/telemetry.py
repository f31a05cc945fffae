"""Throughput with telemetry off, on with a live OTLP receiver, and on with an unreachable endpoint.

    moespec bench telemetry [--rounds 10] [--requests 36] [--clients 1] [--max-new-tokens 32] [--draft-length 3]
    python -m service.bench.telemetry [same options]   (service/cli/bench.py dispatches to add_arguments / run)
    run_benchmark(backend, ...) -> [ModeResult]; format_report(results) -> str   (library use)

What a user gets: each mode has one Telemetry for the whole run, built from the server's default
settings (only the endpoint set: spans batched every 5 s, metrics every 60 s, verify spans for the
server's share of steps, the real OTLP/gRPC exporters and bounded span processor). The live
receiver is `python -m otel.receiver` in its own process, as a collector would be (on a small
machine it still competes for the same cores). "Unreachable" is a loopback port nothing listens on.

Method, for a 2% difference on a shared machine: every mode runs the same waves (one request, or
`--clients N` concurrent requests the engine batches, timed from the wave's start to its last
reply), interleaved wave by wave, the mode order cycling through all six permutations, so load that
drifts over seconds falls on all modes alike. The figure is the geometric mean of the wave-by-wave
ratios of a mode's throughput to off's, with its 95% interval (what the run resolves); the ratios
of whole rounds are reported too (median, lowest, highest), never the best round. Each mode's
throughput = completion tokens / wall seconds of its requests, telemetry calls included. At the
end of a round each mode's queued spans are flushed outside the timed requests (so no mode's
export runs inside another's); its CPU time is charged to that mode's CPU per token (process
time, all threads), the least noisy figure on a shared machine. Metrics keep their own 60 s
schedule. Targets: live >= 98% and unreachable >= 97% of off (the paired figure).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

from otel.api import NoTelemetry
from otel.config import DEFAULT_VERIFY_SPAN_RATIO, TelemetryConfig
from otel.setup import build_telemetry_from_config
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams

MODES = ("off", "live", "unreachable")
ORDERS = tuple(itertools.permutations(MODES))
REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = MappingProxyType({"live": 0.98, "unreachable": 0.97})
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
    relative: float  # tokens_per_second / off's, over the whole run
    paired: float  # geometric mean over waves of (this mode's / off's throughput on the same wave): the figure
    paired_low: float  # its 95% confidence interval (normal on the log ratios): what the run resolves
    paired_high: float
    relative_median: float  # median over rounds of (this mode's / off's throughput in the same round)
    relative_min: float  # the spread of those per-round ratios: lowest ...
    relative_max: float  # ... and highest
    round_ratios: tuple[float, ...]  # every round's ratio, in order
    cpu_ms_per_token: float  # this process's CPU time (all threads, span export included) per token
    cpu_overhead: float  # cpu_ms_per_token / off's - 1
    spans_exported: int
    spans_dropped: int


@dataclass
class Tally:
    """One mode's requests within a round (or the whole run)."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    wave_throughputs: list[float] = field(default_factory=list)  # tok/s of each wave, in run order

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.cpu += other.cpu
        self.wave_throughputs.extend(other.wave_throughputs)


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
    """The server's defaults but for the endpoint (and the verify-span share, its default unless asked)."""
    if mode == "off":
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "MOESPEC_VERIFY_SPAN_RATIO": str(verify_span_ratio)}


def mode_order(index: int) -> tuple[str, ...]:
    """The `index`-th of the modes' orders, cycling through all six: over six requests each mode runs
    first, second and third twice, and directly after each other mode equally often."""
    return ORDERS[index % len(ORDERS)]


def timed_request(backend, telemetry, request: GenerationRequest, policy: DraftPolicy) -> Tally:
    cpu0, t0 = time.process_time(), time.perf_counter()
    with telemetry.request(backend.info, request, policy) as obs:
        result = backend.generate(request, policy)
        obs.finish(result)
    return Tally(1, result.completion_tokens, time.perf_counter() - t0, time.process_time() - cpu0)


def timed_wave(backend, telemetry, requests: Sequence[GenerationRequest], policy: DraftPolicy,
               pool: ThreadPoolExecutor | None) -> Tally:
    """`requests` at once, one client thread each (the engine batches them): the wave's wall time,
    its tokens and the process's CPU time over it. One request without a pool: no thread hop."""
    if pool is None:
        (request,) = requests
        wave = timed_request(backend, telemetry, request, policy)
    else:
        cpu0, t0 = time.process_time(), time.perf_counter()
        done = list(pool.map(lambda r: timed_request(backend, telemetry, r, policy), requests))
        wave = Tally(len(done), sum(d.tokens for d in done), time.perf_counter() - t0, time.process_time() - cpu0)
    wave.wave_throughputs = [wave.tokens_per_second]
    return wave


def flush_spans(telemetry, timeout_ms: int) -> float:
    """Export a mode's queued spans now, outside any timed request -> the CPU seconds it took."""
    provider = getattr(telemetry, "tracer_provider", None)  # None: telemetry off
    cpu0 = time.process_time()
    if provider is not None:
        provider.force_flush(timeout_ms)
    return time.process_time() - cpu0


def run_round(backend, telemetries: dict, requests: Sequence[GenerationRequest], policy: DraftPolicy,
              round_index: int, clients: int = 1, pool: ThreadPoolExecutor | None = None) -> dict[str, Tally]:
    """The same requests in every mode, interleaved wave by wave (`clients` requests at once); then
    each mode's span flush."""
    tallies = {mode: Tally() for mode in MODES}
    waves = [requests[i:i + clients] for i in range(0, len(requests), clients)]
    for i, wave in enumerate(waves):
        for mode in mode_order(round_index * len(waves) + i):
            tallies[mode].add(timed_wave(backend, telemetries[mode], wave, policy, pool))
    for mode in MODES:
        tallies[mode].cpu += flush_spans(telemetries[mode], 2000)
    return tallies


def build_telemetries(backend, receiver_address: str, verify_span_ratio: float) -> dict:
    endpoints = {"off": "", "live": f"http://{receiver_address}", "unreachable": f"http://127.0.0.1:{closed_port()}"}
    telemetries = {}
    for mode in MODES:
        config = TelemetryConfig.from_environ(mode_environ(mode, endpoints[mode], verify_span_ratio))
        telemetries[mode] = build_telemetry_from_config(config, backend.info) if config.enabled else NoTelemetry()
    return telemetries


def run_benchmark(
    backend,
    *,
    rounds: int = 10,
    requests: int = 36,
    clients: int = 1,
    max_new_tokens: int = 32,
    policy: DraftPolicy = BENCH_POLICY,
    verify_span_ratio: float = DEFAULT_VERIFY_SPAN_RATIO,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    log: Callable[[str], None] | None = None,
) -> list[ModeResult]:
    """`backend`: anything with `.info` and `.generate(request, policy)` (the engine, a Backend).
    `requests`: per mode per round, in waves of `clients` concurrent requests (one stream: 1)."""
    batch = [GenerationRequest(prompt=prompts[i % len(prompts)], max_new_tokens=max_new_tokens,
                               sampling=SamplingParams(temperature=0)) for i in range(requests)]
    per_round: list[dict[str, Tally]] = []
    pool = ThreadPoolExecutor(clients, thread_name_prefix="bench-client") if clients > 1 else None
    receiver = start_receiver_process()
    telemetries: dict = {}
    try:
        # One Telemetry per mode for the whole run, as in a long-running server (channels, threads and
        # instruments are set up once, and each mode's first request is not measured).
        telemetries = build_telemetries(backend, receiver.address, verify_span_ratio)
        for mode in MODES:
            timed_request(backend, telemetries[mode], batch[0], policy)
            flush_spans(telemetries[mode], 2000)
        for r in range(rounds):
            per_round.append(run_round(backend, telemetries, batch, policy, r, clients, pool))
            if log:
                log(f"round {r + 1}/{rounds}: {round_line(per_round[-1])}")
        exported = {m: sum(s.exported for s in getattr(t, "export_stats", ())) for m, t in telemetries.items()}
        dropped = {m: t.dropped_spans for m, t in telemetries.items()}
    finally:
        for telemetry in telemetries.values():
            telemetry.shutdown()
        receiver.stop()
        if pool is not None:
            pool.shutdown()
    return summarize(per_round, exported, dropped)


def round_line(tallies: dict[str, Tally]) -> str:
    off = tallies["off"].tokens_per_second
    return f"off {off:7.1f} tok/s  " + "  ".join(f"{m} {tallies[m].tokens_per_second / off:6.1%}" for m in MODES[1:])


def paired_ratio(mode: Sequence[float], off: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of wave-by-wave throughput ratios, with its 95% interval. Each wave of a mode ran
    next to the same wave of off, so drift over seconds cancels pair by pair; the interval is what the
    run can resolve (it narrows as 1/sqrt(waves))."""
    logs = [math.log(m / o) for m, o in zip(mode, off, strict=True)]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def summarize(per_round: Sequence[dict[str, Tally]], exported: dict[str, int],
              dropped: dict[str, int]) -> list[ModeResult]:
    totals = {mode: Tally() for mode in MODES}
    for tallies in per_round:
        for mode in MODES:
            totals[mode].add(tallies[mode])
    off = totals["off"]
    results = []
    for mode, t in totals.items():
        ratios = tuple(r[mode].tokens_per_second / r["off"].tokens_per_second for r in per_round)
        paired, low, high = paired_ratio(t.wave_throughputs, off.wave_throughputs)
        results.append(ModeResult(
            mode, t.requests, t.tokens, t.seconds, t.tokens_per_second, t.tokens_per_second / off.tokens_per_second,
            paired, low, high, statistics.median(ratios), min(ratios), max(ratios), ratios, 1000 * t.cpu / t.tokens,
            (t.cpu / t.tokens) / (off.cpu / off.tokens) - 1, exported[mode], dropped[mode]))
    return results


def format_report(results: Sequence[ModeResult]) -> str:
    """`paired`: the geometric mean of wave-by-wave ratios to off (the figure and the verdict's), with
    `95% CI` its interval (what this run resolves); `round median` / `round range`: the per-round
    ratios' median, lowest and highest (the spread over repeats, never the best round); `vs off`: the
    whole run's ratio; `cpu +`: extra CPU time per token (the least noisy figure on a shared machine)."""
    lines = [f"{'telemetry':<12}{'requests':>9}{'tok/s':>9}{'vs off':>8}{'paired':>8}{'95% CI':>15}"
             f"{'round median':>13}{'round range':>15}{'cpu ms/tok':>11}{'cpu +':>7}{'spans exported':>16}"
             f"{'dropped':>9}  target"]
    for r in results:
        target = TARGETS.get(r.mode)
        verdict = "" if target is None else f">= {target:.0%} {'ok' if r.paired >= target else 'MISSED'}"
        interval = f"{r.paired_low:.1%}-{r.paired_high:.1%}"
        spread = f"{r.relative_min:.1%}-{r.relative_max:.1%}"
        lines.append(f"{r.mode:<12}{r.requests:>9}{r.tokens_per_second:>9.1f}{r.relative:>8.1%}{r.paired:>8.1%}"
                     f"{interval:>15}{r.relative_median:>13.1%}{spread:>15}{r.cpu_ms_per_token:>11.2f}"
                     f"{r.cpu_overhead:>7.1%}{r.spans_exported:>16}{r.spans_dropped:>9}  {verdict}")
    rounds = len(results[0].round_ratios) if results else 0
    lines.append(f"{rounds} rounds; every ratio is a mode's throughput / off's on the same requests, run side by side")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`moespec bench telemetry` options (also `python -m service.bench.telemetry`)."""
    parser.add_argument("--rounds", "--cycles", dest="rounds", type=int, default=10,
                        help="rounds; each gives every mode's ratio to off (default 10)")
    parser.add_argument("--requests", "--block", dest="requests", type=int, default=36,
                        help="requests per mode per round, interleaved with the other modes' (default 36; a "
                             "multiple of 6 balances the mode orders within each round)")
    parser.add_argument("--clients", type=int, default=1,
                        help="concurrent requests per wave, batched by the engine (default 1: one stream)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--draft-length", type=int, default=3, help="model drafter's k (default 3)")
    parser.add_argument("--verify-span-ratio", type=float, default=DEFAULT_VERIFY_SPAN_RATIO,
                        help=f"share of verify steps with a span (default {DEFAULT_VERIFY_SPAN_RATIO}, the "
                             "server's; 1 is the worst case)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: the server's, measured at start-up)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from otel.quiet_logs import quiet_exporter_logs
    from service.engine import Engine, EngineConfig  # torch only when the benchmark really runs
    from service.engine.threads import default_threads
    from service.errors import UsageError

    if min(args.rounds, args.requests, args.clients, args.max_new_tokens) < 1 or not 0 <= args.verify_span_ratio <= 1:
        raise UsageError("--rounds, --requests, --clients and --max-new-tokens must be >= 1; "
                         "--verify-span-ratio in [0, 1]")
    quiet_exporter_logs()  # as `moespec serve` does: a dead collector is logged once, not per export
    engine = Engine(EngineConfig(threads=args.threads or default_threads()))  # the server's thread choice
    results = run_benchmark(engine, rounds=args.rounds, requests=args.requests, clients=args.clients,
                            max_new_tokens=args.max_new_tokens,
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
