"""The load generator: send a prompt set to a server and summarise what came back (throughput,
latency p50/p99, tokens). Behind `moespec loadgen` (its command line: service/cli/loadgen.py), and
run in-process by the demo, the tuner benchmarks and the end-to-end tests.

Two arrival models: closed loop (--concurrency N: N callers, each sends its next request when the
last one returns) and open loop (--rate R: Poisson arrivals at R requests/s, whatever the server
does; a slow server builds a queue and answers RESOURCE_EXHAUSTED, which is counted, not retried).
The run ends after --duration S or --count N requests (or when `stop` is set, for in-process use).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from service.errors import UsageError
from service.server.client import MoespecClient, Reply
from service.types import GenerationRequest, SamplingParams

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "service" / "prompts" / "heldout.jsonl"
# Answers that repeat the prompt (the workload-shift benchmark's second workload; service/prompts/README.md)
REPEAT_PROMPTS = DEFAULT_PROMPTS.with_name("repeat.jsonl")
TABLE_PROMPTS = DEFAULT_PROMPTS.with_name("tables.jsonl")  # the workload-shift benchmark's second set
MAX_OPEN_LOOP_IN_FLIGHT = 64  # open-loop callers; beyond this, arrivals wait for a free caller


def load_prompts(path: Path) -> list[str]:
    """JSON lines with a "prompt" field (the shipped format) or, for any other suffix, one prompt per line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--prompts: cannot read {path}: {e.strerror}") from None
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"--prompts: {path}:{n} is not a JSON object with a \"prompt\"") from None
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts: {path} holds no prompts")
    return prompts


def first_prompts(prompts: list[str], count: int | None) -> list[str]:
    """The first `count` prompts (all when None). A small fixed subset, cycled, makes every trial
    window of about `count` requests serve the same prompts, so policies are compared on the same
    work instead of on whichever prompts their window happened to draw."""
    if count is None:
        return prompts
    if not 1 <= count <= len(prompts):
        raise UsageError(f"--prompt-count must be in [1, {len(prompts)}], got {count}")
    return prompts[:count]


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = 2  # closed loop; exactly one of concurrency / rate
    rate: float | None = None  # open loop, requests per second
    duration: float | None = None  # seconds; with count None and duration None: until stopped
    count: int | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling of the requests (with temperature > 0)
    seed: int | None = None  # arrival times and, when set, per-request sampling seeds


@dataclass
class LoadSummary:
    ok: int = 0
    errors: Counter = field(default_factory=Counter)  # status code name -> count
    prompt_tokens: int = 0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, reply: Reply, latency: float) -> None:
        self.ok += 1
        self.prompt_tokens += reply.prompt_tokens
        self.output_tokens += reply.completion_tokens
        self.latencies.append(latency)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        rank = math.ceil(q / 100 * len(ordered))  # nearest-rank definition
        return ordered[min(len(ordered), max(1, rank)) - 1]

    def as_dict(self) -> dict[str, object]:
        s = max(self.seconds, 1e-9)
        return {
            "requests_ok": self.ok,
            "requests_failed": sum(self.errors.values()),
            "errors": dict(self.errors),
            "seconds": round(self.seconds, 3),
            "requests_per_second": round(self.ok / s, 3),
            "output_tokens_per_second": round(self.output_tokens / s, 2),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "latency_p50_seconds": round(self.percentile(50), 4),
            "latency_p99_seconds": round(self.percentile(99), 4),
        }

    def text(self) -> str:
        d = self.as_dict()
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (f"requests: {d['requests_ok']} ok, {d['requests_failed']} failed ({errors}) in {d['seconds']} s\n"
                f"throughput: {d['requests_per_second']} req/s, {d['output_tokens_per_second']} output tok/s\n"
                f"latency: p50 {d['latency_p50_seconds'] * 1e3:.1f} ms, p99 {d['latency_p99_seconds'] * 1e3:.1f} ms\n"
                f"tokens: {d['prompt_tokens']} prompt, {d['output_tokens']} output")


class LoadGenerator:
    def __init__(
        self,
        client: MoespecClient,
        prompts: list[str],
        spec: LoadSpec,
        on_done: Callable[[LoadSummary], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client = client
        self._prompts = prompts
        self._spec = spec
        self._on_done = on_done or (lambda s: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._summary = LoadSummary()
        self._sent = 0

    def run(self, stop: threading.Event | None = None) -> LoadSummary:
        stop = stop or threading.Event()
        start = self._clock()
        deadline = start + self._spec.duration if self._spec.duration is not None else None
        numbers = itertools.count()
        if self._spec.rate:
            self._open_loop(stop, deadline, numbers)
        else:
            callers = [threading.Thread(target=self._closed_loop, args=(stop, deadline, numbers), daemon=True)
                       for _ in range(self._spec.concurrency or 1)]
            for t in callers:
                t.start()
            try:
                for t in callers:
                    t.join()
            except KeyboardInterrupt:
                stop.set()  # Ctrl-C: let requests in flight finish, then summarise what was done
                for t in callers:
                    t.join()
        with self._lock:
            self._summary.seconds = self._clock() - start
            return self._summary

    def summary(self) -> LoadSummary:
        with self._lock:
            return self._summary

    def _next(self, stop: threading.Event, deadline: float | None, numbers: Iterator[int]) -> int | None:
        """The next request number, or None when the run is over (count, duration or stop)."""
        if stop.is_set() or (deadline is not None and self._clock() >= deadline):
            return None
        with self._lock:
            if self._spec.count is not None and self._sent >= self._spec.count:
                return None
            self._sent += 1
            return next(numbers)

    def _closed_loop(self, stop, deadline, numbers) -> None:
        while (n := self._next(stop, deadline, numbers)) is not None:
            self._send(n)

    def _open_loop(self, stop, deadline, numbers) -> None:
        rng = random.Random(self._spec.seed)
        with ThreadPoolExecutor(MAX_OPEN_LOOP_IN_FLIGHT, thread_name_prefix="loadgen") as pool:
            next_at = self._clock()
            try:
                while (n := self._next(stop, deadline, numbers)) is not None:
                    pool.submit(self._send, n)
                    next_at += rng.expovariate(self._spec.rate)
                    if stop.wait(max(0.0, next_at - self._clock())):
                        break
            except KeyboardInterrupt:
                stop.set()  # the pool's exit waits for requests in flight

    def _request(self, n: int) -> GenerationRequest:
        seed = None if self._spec.seed is None else self._spec.seed + n
        return GenerationRequest(
            prompt=self._prompts[n % len(self._prompts)],
            max_new_tokens=self._spec.max_new_tokens,
            sampling=SamplingParams(temperature=self._spec.temperature, top_p=self._spec.top_p, seed=seed),
        )

    def _send(self, n: int) -> None:
        t0 = self._clock()
        try:
            reply = self._client.generate(self._request(n), timeout=120)
        except grpc.RpcError as e:
            with self._lock:
                self._summary.errors[e.code().name if hasattr(e, "code") else "ERROR"] += 1
                summary = self._summary
        else:
            with self._lock:
                self._summary.add(reply, self._clock() - t0)
                summary = self._summary
        self._on_done(summary)
