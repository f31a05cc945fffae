"""Interleaved timing of verify windows: every (w, U) point once per round, in a fresh random order each
round so drift of the machine hits all points alike; per point and round the median of `repeats`
passes, each over a freshly drawn window (as consecutive passes of a served model route differently,
so no pass finds its experts left in cache by an identical one before it); over rounds the median and
the spread (min, max)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from service.bench.verify_cost.windows import controlled_layers


@dataclass(frozen=True)
class PointTiming:
    window: int
    union: int
    seconds: tuple[float, ...]  # one per round: the median pass of that round

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict:
        return {"window": self.window, "union": self.union, "seconds_median": self.median,
                "seconds_min": min(self.seconds), "seconds_max": max(self.seconds), "seconds": list(self.seconds)}


def cpu_timer(run: Callable[[], object], synchronize: Callable[[], None]) -> tuple[float, object]:
    """(seconds of the pass, what it returned)."""
    t0 = time.perf_counter()
    out = run()
    synchronize()
    return time.perf_counter() - t0, out


def cuda_timer(run: Callable[[], object], synchronize: Callable[[], None]) -> tuple[float, object]:
    """CUDA events around the pass (the device's own clock, no host timing of launches)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, out


def check_unions(routed: Sequence[torch.Tensor], expected: torch.Tensor) -> None:
    """The ids a pass really routed (per layer [w, k]) are the window's, so its union is the one asked."""
    for layer, (got, want) in enumerate(zip(routed, expected, strict=True)):
        if not torch.equal(torch.sort(got.cpu(), dim=1).values, torch.sort(want, dim=1).values):
            raise RuntimeError(f"layer {layer}: the kernel routed other experts than the window asked for")


def measure(layers, points: Sequence[tuple[int, int]], rounds: int, repeats: int, seed: int = 0,
            timer: Callable = cpu_timer, progress: Callable[[str], None] | None = None) -> list[PointTiming]:
    """layers: FusedCpuLayers or TorchLayers (n_layers, routes_itself, prepare(ids), run(), synchronize());
    points: (w, U)."""
    g = layers.geometry
    order_rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    with torch.inference_mode():  # as the engine's scheduler loop runs every pass
        for r in range(rounds):
            order = list(points)
            order_rng.shuffle(order)
            for w, u in order:
                runs = []
                for _ in range(repeats):
                    ids = controlled_layers(layers.n_layers, w, g.top_k, g.experts, u, generator)
                    layers.prepare(ids)
                    seconds, routed = timer(layers.run, layers.synchronize)
                    if layers.routes_itself:  # every timed pass routed the window asked for
                        check_unions(routed, ids)
                    runs.append(seconds)
                times[(w, u)].append(statistics.median(runs))
            if progress:
                progress(f"round {r + 1}/{rounds} done")
    return [PointTiming(w, u, tuple(times[(w, u)])) for w, u in points]
