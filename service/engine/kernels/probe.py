"""The machine probes of the step limit (service/bench/limit.py), in a library of their own.

Benchmarks only, so the library the engine loads carries none of it: csrc/probe.c and the pool it
splits over are compiled from csrc/unity_probe.c at first use, by the same build as the kernels'
library (c_build.py: its flags, its cache and the cache's checks), so a probe runs the kernels'
compiler flags on the same pool code.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from service.engine.kernels import c_build
from service.engine.kernels import pool as kernel_pool
from service.engine.kernels.pool import KernelPool

FMA_CHAINS, LANES = 12, 16  # probe.c: multiply-add chains per round, lanes per chain


class Probes:
    """The loaded probe library."""

    def __init__(self, library_path: Path):
        self.path = library_path
        lib = kernel_pool.load(library_path)
        self._lib = lib
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._read = lib.probe_read
        self._read.argtypes = [ptr, i64, i64, ptr]
        self._read.restype = ctypes.c_float
        self._fma = lib.probe_fma
        self._fma.argtypes = [i64, ptr]
        self._fma.restype = ctypes.c_float

    def pool(self, threads: int) -> KernelPool:
        """Start `threads - 1` workers for the probes to split over (a pool of this library: the
        kernels' pools belong to theirs)."""
        return KernelPool(self._lib, threads)

    def read(self, buf: torch.Tensor, reps: int, pool: KernelPool | None = None) -> float:
        """Read a contiguous float32 CPU buffer `reps` times in whole blocks of 128 floats, split over
        the pool's threads (see probe.c); returns the sum of what was read (so the reads cannot be
        skipped)."""
        if buf.dtype != torch.float32 or not buf.is_contiguous() or not buf.is_cpu or reps < 1:
            raise ValueError("probe read: a contiguous float32 CPU buffer and reps >= 1")
        return self._read(buf.data_ptr(), buf.numel(), reps, _handle(pool))

    def fma(self, reps: int, pool: KernelPool | None = None) -> int:
        """`reps` rounds of fused multiply-adds on every thread of the pool (see probe.c) -> the
        flops done (2 per multiply-add)."""
        if reps < 1:
            raise ValueError("probe fma: reps >= 1")
        self._fma(reps, _handle(pool))
        return 2 * LANES * FMA_CHAINS * reps * (pool.threads if pool is not None else 1)


def _handle(pool: KernelPool | None) -> int | None:
    return None if pool is None else pool.handle


def build(cache_dir: Path | None = None, compiler: str | None = None) -> Probes:
    """Compile (or reuse) the probe library and load it. Raises c_build.NoCompiler without a C
    compiler, OSError or subprocess.SubprocessError when it cannot be built: a benchmark that asks for
    the step limit cannot go on without it."""
    return c_build.build_library("unity_probe.c", Probes, cache_dir, compiler)
