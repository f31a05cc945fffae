"""`moespec loadgen`: send the shipped prompt set (or --prompts FILE) to a server, with a progress bar
on stderr and a summary (throughput, latency p50/p99, tokens) on stdout.

The flags, their checks into a LoadSpec, and the terminal view; the load itself is
tuner/drivers/loadgen.py. The run ends after --duration S or --count N requests (default 30 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import TextIO

from service.errors import UsageError
from service.server.client import MoespecClient
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, LoadSummary, first_prompts, load_prompts

EXIT_UNREACHABLE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Send a prompt workload to a moespec server (closed loop --concurrency, or open loop "
                          "--rate) for --duration seconds or --count requests; progress on stderr, summary on "
                          "stdout. Exit 3 when the server cannot be reached.")
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the server")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: callers in parallel (default 2)")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    end = parser.add_mutually_exclusive_group()
    end.add_argument("--duration", type=float, default=None, help="seconds to run (default 30)")
    end.add_argument("--count", type=int, default=None, help="requests to send")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help="JSONL with a \"prompt\" field per line, or plain text, one prompt per line "
                             "(default: the shipped held-out set)")
    parser.add_argument("--prompt-count", type=int, default=None, help="use only the first N prompts (cycled)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="request sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="request nucleus sampling, with --temperature > 0")
    parser.add_argument("--seed", type=int, default=None, help="seed arrivals and per-request sampling")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the server")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if args.rate is not None and not args.rate > 0:
        raise UsageError("--rate must be > 0")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be > 0")
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be >= 1")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if not args.temperature >= 0:
        raise UsageError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    duration = args.duration if args.duration is not None or args.count is not None else 30.0
    return LoadSpec(
        concurrency=None if args.rate else (args.concurrency or 2),
        rate=args.rate,
        duration=duration,
        count=args.count,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


class ProgressBar:
    """tqdm on stderr, counting requests (or seconds, for a duration-bound run)."""

    def __init__(self, spec: LoadSpec, stream: TextIO, enabled: bool):
        self._bar = None
        self._spec = spec
        if enabled:
            from tqdm import tqdm  # an Optuna dependency, so always present

            total = spec.count if spec.count is not None else None
            self._bar = tqdm(total=total, unit="req", file=stream, dynamic_ncols=True)
        self._lock = threading.Lock()

    def update(self, summary: LoadSummary) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.update(1)
            self._bar.set_postfix(tok=summary.output_tokens, err=sum(summary.errors.values()), refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
    with MoespecClient(args.server) as client:
        try:
            client.wait_ready(timeout=args.connect_timeout)
        except TimeoutError as e:
            print(f"moespec loadgen: error: server unreachable: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
        bar = ProgressBar(spec, sys.stderr, enabled=not args.no_progress)
        try:
            summary = LoadGenerator(client, prompts, spec, on_done=bar.update).run()
        finally:
            bar.close()
    print(json.dumps(summary.as_dict(), indent=2) if args.json else summary.text())
    return 0 if summary.ok else 1
