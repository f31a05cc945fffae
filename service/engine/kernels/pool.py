"""Worker threads the fused kernels split a big pass over, started once per engine.

Why: a batched decode step of 16 requests makes ~9 kernel calls of 0.1-0.8 ms each; starting a thread
per call cost ~85 us on the 2-core development machine (a fresh stack to fault in every time), more
than splitting saved for attention. A pool's workers stay warm: after a task a worker polls for the
next one, busy for 50 us (the next call of the same pass), then yielding its core between polls
(sched_yield: any other runnable thread, the server's, takes it) until `spin_us`, then sleeps on a
condition variable, so an idle engine leaves the core alone. Why `spin_us` is 1 ms: one request's
decode loop spends a few hundred microseconds of its own work between two passes, and a worker asleep by
then wakes tens of microseconds into the next pass, whose first calls run on the caller alone; polling
through that gap made plain single-stream decoding ~1.2x faster (2-core Intel Xeon, interleaved).

Contract of `pool_rows(pool, fn, ctx, n)` (csrc/kernel_pool.c, the first file of each library built from
csrc/, declared in kernel_pool.h):
- Runs fn(ctx, begin, end) over rows [0, n) split into up to workers + 1 contiguous ranges; returns
  when every range is done. fn must compute each row on its own (the kernels' contract), so the split
  changes no bit of the result.
- Ranges are claimed, not assigned: the caller and each woken worker take the next unclaimed range
  until none is left, and the caller waits only for ranges another thread has claimed. A worker the
  OS has not run yet (on 2 cores the server's own threads often hold the other one) claims nothing and
  is never waited for: the caller runs its range too, instead of stalling the pass until it is scheduled.
- pool NULL, one row, a pool already running another caller's task, or a forked child's copy of a
  pool (it has no workers): the caller runs all rows alone.
- A worker that could not be started is simply not there (fewer ranges).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass


def load(library_path) -> ctypes.CDLL:
    """A built library (kernels or probes: both carry the pool's C), with the pool's functions declared."""
    lib = ctypes.CDLL(str(library_path))
    lib.kernel_pool_create.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.kernel_pool_create.restype = ctypes.c_void_p
    lib.kernel_pool_workers.argtypes = [ctypes.c_void_p]
    lib.kernel_pool_workers.restype = ctypes.c_int64
    lib.kernel_pool_destroy.argtypes = [ctypes.c_void_p]
    lib.kernel_pool_destroy.restype = None
    return lib


class KernelPool:
    """`threads - 1` started workers (the calling thread is the other); pass it to the kernels' calls.
    `close()` (or garbage collection) stops them; a closed pool's calls run on the calling thread."""

    def __init__(self, lib: ctypes.CDLL, threads: int, spin_us: float = 1000.0):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"kernel threads must be an int >= 1, got {threads!r}")
        handle = lib.kernel_pool_create(threads - 1, int(spin_us * 1000))
        if not handle:
            raise MemoryError("could not allocate the kernel thread pool")
        self._handle: int | None = handle
        # Workers that could not be started are not there: say how many run.
        self.threads = 1 + lib.kernel_pool_workers(handle)
        self._finalizer = weakref.finalize(self, lib.kernel_pool_destroy, handle)

    @property
    def handle(self) -> int | None:
        """The C pool to pass (None once closed: calls then run alone)."""
        return self._handle

    def close(self) -> None:
        """Stop the workers; call after the last kernel call that uses the pool."""
        self._handle = None
        self._finalizer()

    def __repr__(self) -> str:
        return f"KernelPool(threads={self.threads}{', closed' if self._handle is None else ''})"


@dataclass(frozen=True)
class KernelThreads:
    """When a kernel call splits its work over the pool's threads: from a kernel's minimum number of
    positions in the pass on (no pool: never). Splitting never changes a bit of the result (every
    position and output column is computed on its own). A one-position decode step pays in every
    kernel: the MoE block splits by expert, attention (up to 4 positions) by kv head and then output
    columns, the output layer by output columns, so each weight is read once, by one thread; at the
    shipped model's size the weights come from the shared cache, and reading them is most of a step.
    With the whole layer loop in one call (decoder.py) the pool's workers are still polling from the
    previous call when the next one comes (single-stream plain decoding with and without the split:
    docs/engine.md). Longer passes split attention by token."""

    pool: KernelPool | None = None
    moe_min_positions: int = 1
    linear_min_positions: int = 1
    attention_min_positions: int = 1

    @property
    def threads(self) -> int:
        return self.pool.threads if self.pool is not None else 1

    def moe(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.moe_min_positions else None

    def linear(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.linear_min_positions else None

    def attention(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.attention_min_positions else None

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.threads == 1:
            return "kernel threads: 1 (no pass is split)"
        moe = self.moe_min_positions
        return (f"kernel threads: {self.threads} (a pass's work splits over them from {moe} "
                f"position{'s' if moe != 1 else ''} in the MoE block, {self.linear_min_positions} in the output layer, "
                f"{self.attention_min_positions} in attention)")


ONE_THREAD = KernelThreads()  # no call is split (frozen: a safe default)
