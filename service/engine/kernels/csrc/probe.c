/* Machine probes for the step limit (service/bench/limit.py): how fast this CPU reads a buffer that
   is already in its caches, and how many fused multiply-adds it retires, with the kernels' own
   compiler flags and split over the same pool code. Benchmarks only: they are their own library
   (unity_probe.c, probe.py), not part of the kernels'. */
#include "kernel_pool.h"

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

struct probe_args { const float *buf; int64_t n, reps, parts; float *sums; };

/* Part p of [0, n) read `reps` times, in whole blocks of 128 floats (a tail past the last block is not
   read): eight independent sums of 16 lanes (more loads in flight than one chain allows); the sums
   are returned so the compiler cannot drop the loads. */
static void probe_read_parts(const void *ctx, int64_t begin, int64_t end) {
    const struct probe_args *a = ctx;
    for (int64_t part = begin; part < end; part++) {
        const int64_t blocks = a->n / 128, lo = blocks * part / a->parts * 128,
                      hi = blocks * (part + 1) / a->parts * 128;
        float s = 0.0f;
#if defined(__AVX512F__)
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t r = 0; r < a->reps; r++)
            for (int64_t i = lo; i + 128 <= hi; i += 128)
                for (int j = 0; j < 8; j++) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(a->buf + i + 16 * j));
        for (int j = 0; j < 8; j++) s += _mm512_reduce_add_ps(acc[j]);
#else
        float acc[128] = {0};
        for (int64_t r = 0; r < a->reps; r++)
            for (int64_t i = lo; i + 128 <= hi; i += 128)
                for (int j = 0; j < 128; j++) acc[j] += a->buf[i + j];
        for (int j = 0; j < 128; j++) s += acc[j];
#endif
        a->sums[part] = s;
    }
}

/* Part p: `reps` rounds of twelve independent multiply-add chains of 16 lanes (enough chains to
   cover the FMA latency on two pipes), 2 * 16 * 12 flops a round. */
static void probe_fma_parts(const void *ctx, int64_t begin, int64_t end) {
    const struct probe_args *a = ctx;
    for (int64_t part = begin; part < end; part++) {
        float s = 0.0f;
#if defined(__AVX512F__)
        const __m512 mul = _mm512_set1_ps(0.9999999f), add = _mm512_set1_ps(1e-7f);
        __m512 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_set1_ps((float)(part + j));
        for (int64_t r = 0; r < a->reps; r++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_fmadd_ps(acc[j], mul, add);
        for (int j = 0; j < 12; j++) s += _mm512_reduce_add_ps(acc[j]);
#else
        float acc[12 * 16];
        for (int j = 0; j < 12 * 16; j++) acc[j] = (float)(part + j);
        for (int64_t r = 0; r < a->reps; r++)
            for (int j = 0; j < 12 * 16; j++) acc[j] = fmaf(acc[j], 0.9999999f, 1e-7f);
        for (int j = 0; j < 12 * 16; j++) s += acc[j];
#endif
        a->sums[part] = s;
    }
}

/* One part per thread of the pool (this thread alone without one); returns the parts' sum. */
static float probe_run(rows_fn fn, const float *buf, int64_t n, int64_t reps, struct kernel_pool *pool) {
    const int64_t parts = pool ? pool->workers + 1 : 1;
    float sums[parts], total = 0.0f;
    const struct probe_args a = {buf, n, reps, parts, sums};
    pool_rows(pool, fn, &a, parts);
    for (int64_t p = 0; p < parts; p++) total += sums[p];
    return total;
}

float probe_read(const float *buf, int64_t n, int64_t reps, struct kernel_pool *pool) {
    return probe_run(probe_read_parts, buf, n, reps, pool);
}

float probe_fma(int64_t reps, struct kernel_pool *pool) { return probe_run(probe_fma_parts, NULL, 0, reps, pool); }
