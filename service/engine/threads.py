"""Pick torch's intra-op thread count for the machine the server runs on, by measuring.

No fixed rule held up: on one 2-core machine 2 intra-op threads were slower than 1 in some runs
and faster in others (docs/engine.md, "The fast step and the thread default"); which wins depends
on the step's kernels and on what else the machine runs. So the server measures at start-up: a
short request (prefill + decode steps) at each candidate (1, 2, 4, ... and all usable cores),
interleaved over rounds so drift hits all alike; the lowest median wins, and a candidate within
`tolerance` of a faster one with fewer threads loses to it (fewer threads leave more CPU to the
gRPC threads and everything else for the same speed).

The server keeps one core out of the candidates (`reserved`): its scheduler loop, gRPC threads and
callers need CPU between the model's ops, and torch's intra-op workers spin-wait between ops on every
core they hold. A request timed alone cannot see that (nothing else wants the CPU), so it is a rule,
from a measurement of `moespec bench server` at several clients (the same page).

`choose` takes the measurement as a callable so the selection can be tested on any real workload;
`request_timer` is the measurement the server uses.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int
    candidates: tuple[int, ...]
    seconds: dict[int, float] = field(default_factory=dict)  # median seconds per candidate; empty: no choice
    reserved: int = 0  # cores left out of the candidates, for the server's own threads

    def describe(self) -> str:
        """One line for the start-up log: what was picked, from what, and why."""
        kept = f", {self.reserved} kept for the server's own threads" if self.reserved else ""
        if len(self.candidates) == 1:
            return f"torch intra-op threads: {self.threads} ({self.cores} usable cores{kept}: nothing to measure)"
        timed = ", ".join(f"{t}: {s * 1e3:.1f} ms" for t, s in sorted(self.seconds.items()))
        return (f"torch intra-op threads: {self.threads} ({self.cores} usable cores{kept}; a short request "
                f"(prefill + 16 steps) by threads, median: {timed})")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def candidates(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... below cores, and cores."""
    top = max(1, cores)
    counts = {top}
    t = 1
    while t < top:
        counts.add(t)
        t *= 2
    return tuple(sorted(counts))


def choose(cores: int, measure: Callable[[int], float], rounds: int = 3, tolerance: float = 0.05,
           hopeless: float = 3.0, reserved: int = 0) -> ThreadChoice:
    """Measure every candidate for `cores` less `reserved` `rounds` times, interleaved (order
    reversed every other round); a candidate `hopeless` times slower than the best in the first round
    is not measured again (it cannot win, and on a crowded machine its rounds can take seconds)."""
    reserved = min(reserved, cores - 1)
    options = candidates(cores - reserved)
    if len(options) == 1:
        return ThreadChoice(options[0], cores, options, reserved=reserved)
    samples: dict[int, list[float]] = {t: [] for t in options}
    for r in range(rounds):
        if r == 1:
            best = min(v[0] for v in samples.values())
            live = [t for t in options if samples[t][0] <= best * hopeless]
        else:
            live = live if r else options
        for t in live if r % 2 == 0 else reversed(live):
            samples[t].append(measure(t))
    medians = {t: statistics.median(v) for t, v in samples.items()}
    fastest = min(medians.values())
    # The fewest threads whose median is within tolerance of the fastest.
    pick = min(t for t, s in medians.items() if s <= fastest * (1 + tolerance))
    return ThreadChoice(pick, cores, options, medians, reserved)


def request_timer(model, steps: int = 16, prompt_tokens: int = 96) -> Callable[[int], float]:
    """A measurement for `choose`: wall seconds of a short request to `model` (an inference
    Transformer) on a scratch cache, with torch set to the given thread count: a prefill (matmuls
    that threads can split) and plain decode steps (small ops they mostly cannot), as served."""
    from service.engine.model.ragged import KVCache

    cache = KVCache(model.cfg, prompt_tokens + steps + 1)
    prompt = torch.arange(prompt_tokens) % model.cfg.vocab_size

    def measure(threads: int) -> float:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            t0 = time.perf_counter()
            token = model.forward(prompt, 0, cache).logits[-1:].argmax(-1)
            for i in range(steps):
                token = model.forward(token, prompt_tokens + i, cache).logits.argmax(-1)
            return time.perf_counter() - t0

    return measure


def pick_threads(model, cores: int | None = None, reserved: int = 1) -> ThreadChoice:
    """Choose for this machine by timing `model`, one core kept for the server's own threads (the
    module docstring says why), and leave torch set to the choice."""
    choice = choose(cores or usable_cores(), request_timer(model), reserved=reserved)
    torch.set_num_threads(choice.threads)
    return choice


def default_threads() -> int:
    """Measure the thread counts worth trying on this machine (engine.threads) and say which won."""
    from service.engine.kernels.library import build
    from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

    choice = pick_threads(load_for_inference(DEFAULT_TARGET_DIR, kernels=build()))
    print(f"moespec: {choice.describe()}", file=sys.stderr, flush=True)
    return choice.threads
