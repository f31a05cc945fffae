/* The worker pool: its contract is in pool.py. */
#include "kernel_pool.h"

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

KERNEL_PRIVATE int64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Busy polls of a waiting worker before it starts yielding its core between polls. */
#define PAUSE_SPIN_NS 50000

/* Wait until `generation` moves past `seen`: poll with pause for PAUSE_SPIN_NS (the next call of the
   same pass), then with sched_yield between polls until spin_ns (the next step of a decode loop comes
   after a few hundred microseconds of the engine's own work; a worker asleep by then wakes tens of
   microseconds late, and the step's first calls run on the caller alone. Yielding hands the core to any
   other runnable thread, the server's, meanwhile), then sleep. Returns the new value. */
static long pool_wait(struct kernel_pool *p, long seen) {
    const int64_t start = monotonic_ns();
    long g;
    for (int64_t spins = 1; (g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen; spins++) {
        SPIN_PAUSE();
        if (spins % 64 != 0) continue;
        const int64_t waited = monotonic_ns() - start;
        if (waited > p->spin_ns) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
            break;
        }
        if (waited > PAUSE_SPIN_NS) sched_yield();
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

KERNEL_PRIVATE void pool_rows(struct kernel_pool *p, rows_fn fn, const void *ctx, int64_t n) {
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
    const int64_t until = monotonic_ns() + p->spin_ns;
    for (int64_t spins = 1; atomic_load_explicit(&p->done, memory_order_acquire) < ranges; spins++) {
        SPIN_PAUSE();
        if (spins % 64 == 0 && monotonic_ns() > until) sched_yield();
    }
    pthread_mutex_unlock(&p->busy);
}

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
