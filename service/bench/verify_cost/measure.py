"""Interleaved timing of verify windows: every (w, U) point once per round, in a fresh random order each
round so drift of the machine hits all points alike; per point and round the median of `repeats`
passes; over rounds the median and the spread (min, max)."""

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


def cpu_timer(run: Callable[[], object], synchronize: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    run()
    synchronize()
    return time.perf_counter() - t0


def cuda_timer(run: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """CUDA events around the pass (the device's own clock, no host timing of launches)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


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
    for r in range(rounds):
        order = list(points)
        order_rng.shuffle(order)
        for w, u in order:
            ids = controlled_layers(layers.n_layers, w, g.top_k, g.experts, u, generator)  # a fresh window per round
            layers.prepare(ids)
            routed = layers.run()  # warm-up pass (its ids checked where the kernel routes)
            layers.synchronize()
            if layers.routes_itself:
                check_unions(routed, ids)
            runs = [timer(layers.run, layers.synchronize) for _ in range(repeats)]
            times[(w, u)].append(statistics.median(runs))
        if progress:
            progress(f"round {r + 1}/{rounds} done")
    return [PointTiming(w, u, tuple(times[(w, u)])) for w, u in points]
