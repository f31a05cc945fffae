"""The memory guard: a measurement's weights must fit in this machine's RAM (or the GPU's memory)
before anything is allocated; refusing with the numbers beats an out-of-memory kill halfway through."""

from __future__ import annotations

from pathlib import Path

from service.bench.verify_cost.geometry import Geometry

HEADROOM = 0.8  # of the available memory the weights may take: the runs' activations, Python, the OS


class MemoryGuardError(ValueError):
    """The asked measurement does not fit; the message says how much it needs and how much is there."""


def weight_bytes(geometry: Geometry, layers: int, bytes_per_weight: int, attention: bool) -> int:
    return layers * geometry.layer_params(attention) * bytes_per_weight


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable of this machine (what can be allocated without swapping out others)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def check_bytes(geometry: Geometry, need: int, available: int) -> int:
    """`need` (a whole model's bytes), or MemoryGuardError when it exceeds HEADROOM of `available`."""
    if need > HEADROOM * available:
        raise MemoryGuardError(
            f"geometry {geometry.name!r}'s whole model needs {need / 2**30:.1f} GiB, more than {HEADROOM:.0%} of the "
            f"{available / 2**30:.1f} GiB available: run with --context 0 (the MoE blocks alone, fewer layers)")
    return need


def check_fits(geometry: Geometry, layers: int, bytes_per_weight: int, attention: bool, available: int) -> int:
    """The weights' bytes, or MemoryGuardError when they exceed HEADROOM of `available`."""
    if layers < 1:
        raise MemoryGuardError(f"--layers must be >= 1, got {layers}")
    need = weight_bytes(geometry, layers, bytes_per_weight, attention)
    if need > HEADROOM * available:
        per_layer = need / layers
        fits = int(HEADROOM * available // per_layer)
        hint = f"at most {fits} layer(s) fit" if fits else "not even one layer fits"
        raise MemoryGuardError(
            f"geometry {geometry.name!r} x {layers} layer(s) needs {need / 2**30:.1f} GiB of weights, more than "
            f"{HEADROOM:.0%} of the {available / 2**30:.1f} GiB available: {hint}")
    return need
