"""Worker threads the fused kernels split a big pass over, started once per engine.

Why: a batched decode step of 16 requests makes ~9 kernel calls of 0.1-0.8 ms each; starting a thread
per call cost ~85 us on the 2-core development machine (a fresh stack to fault in every time), more
than splitting saved for attention. A pool's workers stay warm: after a task a worker spins for
`spin_us` (the next call of the same step usually comes within that), then sleeps on a condition
variable until the next task, so between steps and while one request decodes alone it leaves the core
to the server's other threads.

Contract of `pool_rows(pool, fn, ctx, n)` (C, compiled into the kernels' library ahead of their source):
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

SOURCE = r"""
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() ((void)0)
#endif

typedef void (*rows_fn)(const void *ctx, int64_t begin, int64_t end);

struct kernel_pool {
    int64_t workers, spin_ns;
    pid_t owner;  /* a forked child has the pool's memory but not its threads: it runs alone */
    pthread_t *threads;
    pthread_mutex_t busy;  /* held by the caller whose task runs */
    pthread_mutex_t mu;    /* with `wake`: sleeping workers */
    pthread_cond_t wake;
    atomic_long generation;  /* one more per task (and at shutdown): wakes the workers */
    atomic_int stop;
    /* The current task, written by its caller before `ticket` names it. Atomic because a worker that
       wakes late may read them while the next caller writes them; it acts on what it read only once its
       claim on the ticket succeeds, which proves they are that task's (see pool_work). */
    _Atomic(rows_fn) fn;
    _Atomic(const void *) ctx;
    atomic_llong n;
    atomic_ullong ticket;  /* task number << 32 | ranges << 16 | next range to claim */
    atomic_llong done;     /* ranges of the current task finished */
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Wait until `generation` moves past `seen`: spin up to spin_ns, then sleep. Returns the new value. */
static long pool_wait(struct kernel_pool *p, long seen) {
    const int64_t until = now_ns() + p->spin_ns;
    long g;
    for (int64_t spins = 1; (g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen; spins++) {
        SPIN_PAUSE();
        if (spins % 64 == 0 && now_ns() > until) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
    return g;
}

/* Claim and run ranges of the current task until none is left. A claim is a compare-and-swap of the
   ticket from (task, ranges, i) to i + 1: if it succeeds, range i of that task was unclaimed, so the
   task is not finished, its caller still waits (its ctx is alive) and has not written another task's
   fn, ctx or n, so the ones read before the claim are this task's. */
static void pool_work(struct kernel_pool *p) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&p->ticket, memory_order_acquire);
        const uint64_t ranges = (t >> 16) & 0xFFFF, i = t & 0xFFFF;
        if (i >= ranges) return;
        const rows_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        const void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
        const int64_t n = atomic_load_explicit(&p->n, memory_order_relaxed);
        if (!atomic_compare_exchange_weak_explicit(&p->ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        fn(ctx, n * (int64_t)i / (int64_t)ranges, n * (int64_t)(i + 1) / (int64_t)ranges);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *pool_worker_main(void *arg) {
    struct kernel_pool *p = arg;
    long seen = 0;
    for (;;) {
        seen = pool_wait(p, seen);
        if (atomic_load(&p->stop)) return NULL;
        pool_work(p);
    }
}

static void pool_signal(struct kernel_pool *p) {
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

static void pool_rows(struct kernel_pool *p, rows_fn fn, const void *ctx, int64_t n) {
    if (p == NULL || p->workers == 0 || n < 2 || p->owner != getpid() || pthread_mutex_trylock(&p->busy) != 0) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    const int64_t ranges = n < p->workers + 1 ? n : p->workers + 1;
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n, n, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    const uint64_t task = (atomic_load_explicit(&p->ticket, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&p->ticket, task << 32 | (uint64_t)ranges << 16, memory_order_release);
    pool_signal(p);
    pool_work(p);
    /* Wait for the ranges other threads claimed; past spin_ns yield the core, in case one of them waits
       for it (on 2 cores the server's threads may hold the other). */
    const int64_t until = now_ns() + p->spin_ns;
    for (int64_t spins = 1; atomic_load_explicit(&p->done, memory_order_acquire) < ranges; spins++) {
        SPIN_PAUSE();
        if (spins % 64 == 0 && now_ns() > until) sched_yield();
    }
    pthread_mutex_unlock(&p->busy);
}

void kernel_pool_destroy(struct kernel_pool *p);

struct kernel_pool *kernel_pool_create(int64_t workers, int64_t spin_ns) {
    struct kernel_pool *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->spin_ns = spin_ns;
    p->owner = getpid();
    p->threads = calloc((size_t)(workers > 0 ? workers : 1), sizeof *p->threads);
    pthread_mutex_init(&p->busy, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    if (p->threads == NULL) { kernel_pool_destroy(p); return NULL; }
    for (int64_t i = 0; i < workers; i++) {
        if (pthread_create(&p->threads[i], NULL, pool_worker_main, p) != 0) break;
        p->workers = i + 1;
    }
    return p;
}

int64_t kernel_pool_workers(const struct kernel_pool *p) { return p->workers; }

/* Waits for a running task, stops and joins the workers, frees the pool. */
void kernel_pool_destroy(struct kernel_pool *p) {
    pthread_mutex_lock(&p->busy);
    atomic_store(&p->stop, 1);
    pool_signal(p);
    for (int64_t i = 0; i < p->workers; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_unlock(&p->busy);
    pthread_mutex_destroy(&p->busy);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p);
}
"""


def bind(lib: ctypes.CDLL) -> None:
    """Declare the pool's C functions on the loaded library."""
    lib.kernel_pool_create.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.kernel_pool_create.restype = ctypes.c_void_p
    lib.kernel_pool_workers.argtypes = [ctypes.c_void_p]
    lib.kernel_pool_workers.restype = ctypes.c_int64
    lib.kernel_pool_destroy.argtypes = [ctypes.c_void_p]
    lib.kernel_pool_destroy.restype = None


class KernelPool:
    """`threads - 1` started workers (the calling thread is the other); pass it to the kernels' calls.
    `close()` (or garbage collection) stops them; a closed pool's calls run on the calling thread."""

    def __init__(self, lib: ctypes.CDLL, threads: int, spin_us: float = 100.0):
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
    position and output column is computed on its own). The MoE block and attention need 2 positions;
    the output layer splits its columns, so even one position pays. Measured on the 2-core development
    machine (AMD EPYC, in-process, shipped model, a warm pool of 2, ms per call, 1 -> 2 threads): MoE
    block 1.14 -> 0.81 at 16 positions (split by position; by expert, the C source, 0.20 against 0.21 on
    recorded calls at a later, faster moment); attention 0.076 -> 0.049 at 2 and 0.30 -> 0.20 at 16;
    output layer 0.077 -> 0.046 at 1 and 0.45 -> 0.34 at 16. A single position: attention has nothing
    to split (0.047 -> 0.049); the MoE block split by expert took 0.035 against 0.052 ms on replayed
    calls, but real single-stream decoding gained nothing (two engines alternating, 4 runs of 12 rounds:
    median per-round ratio 0.91, 1.04, 0.96, 1.00), and a split step also waits for the other thread to
    wake, so one position stays on one thread."""

    pool: KernelPool | None = None
    moe_min_positions: int = 2
    linear_min_positions: int = 1
    attention_min_positions: int = 2

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
