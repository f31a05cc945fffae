/* The worker pool the kernels split a pass over (kernel_pool.c; its contract is in pool.py): what the
   kernels and the machine probes that use it share. */
#ifndef MOESPEC_KERNEL_POOL_H
#define MOESPEC_KERNEL_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "linkage.h"

typedef void (*rows_fn)(const void *ctx, int64_t begin, int64_t end);

/* In the header because callers read `workers` (one range per thread of the pool). */
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

/* CLOCK_MONOTONIC in nanoseconds: the pool's spin deadlines and the kernels' own step clocks. */
KERNEL_PRIVATE int64_t monotonic_ns(void);

/* fn(ctx, begin, end) over rows [0, n), split over the pool's threads (pool NULL: this thread alone). */
KERNEL_PRIVATE void pool_rows(struct kernel_pool *p, rows_fn fn, const void *ctx, int64_t n);

/* Entry points (pool.py binds them). */
struct kernel_pool *kernel_pool_create(int64_t workers, int64_t spin_ns);
int64_t kernel_pool_workers(const struct kernel_pool *p);
void kernel_pool_destroy(struct kernel_pool *p);

#endif
