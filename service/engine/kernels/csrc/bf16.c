/* bf16 arithmetic for the products over format-2 panels (math="bf16", packed.py); matmul.c's
   matmul_panels calls it.

   Why: a prefill is compute-bound (the float32 tiles run near this CPU's FMA rate) and batching cannot
   make it cheaper; VDPBF16PS multiplies 32 bf16 pairs per instruction where float32 FMAs do 16. The
   inputs are rounded to bf16 and the products summed in float32, each output in a fixed order whatever
   else is in the pass, so rows stay independent (greedy speculation == plain decoding, batch-invariant
   outputs) exactly as in float32. Without the instruction the same sums run as FMAs, bitwise alike. */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Panel format 2, bf16 arithmetic (`PackedWeight`, math="bf16"): a panel holds [ceil(Kd / 2), 64, 2]
   bf16, each column's weights for k and k + 1 side by side, and x is rounded to bf16 (round to nearest
   even, subnormals to zero) in pairs the same way; then every output is, over k pairs ascending,
   acc += x[k+1] w[k+1], then acc += x[k] w[k], each product exact in float32 and each sum rounded once:
   VDPBF16PS's arithmetic, 32 products per instruction where float32 FMAs do 16. Without that
   instruction the same sums are two FMAs each (the same results wherever the instruction follows its
   specification). Rows stay independent as in matmul_p. */
static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7F800000u) == 0) return (uint16_t)((bits >> 16) & 0x8000u);  /* zero and subnormals */
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* xb [rows, 2 * Kd2] = x [rows, Kd] rounded to bf16, a zero after an odd Kd. */
KERNEL_PRIVATE void bf16_rows(const float *x, int64_t rows, int64_t Kd, int64_t Kd2, uint16_t *xb) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * Kd;
        uint16_t *o = xb + t * 2 * Kd2;
        int64_t k = 0;
#if defined(__AVX512BF16__)
        for (; k + 16 <= Kd; k += 16)
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
#endif
        for (; k < Kd; k++) o[k] = bf16_round(xr[k]);
        if (Kd & 1) o[Kd] = 0;
    }
}

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
#define DP_PAIR(ACC, XP, W) ACC = _mm512_dpbf16_ps(ACC, (__m512bh)_mm512_set1_epi32((int)(XP)), (__m512bh)(W))
#else
#define DP_PAIR(ACC, XP, W) do {                                                                          \
    ACC = _mm512_fmadd_ps(_mm512_set1_ps(bf16_value((uint16_t)((XP) >> 16))),                               \
                          _mm512_castsi512_ps(_mm512_and_si512(W, _mm512_set1_epi32((int)0xFFFF0000u))), ACC); \
    ACC = _mm512_fmadd_ps(_mm512_set1_ps(bf16_value((uint16_t)(XP))),                                       \
                          _mm512_castsi512_ps(_mm512_slli_epi32(W, 16)), ACC);                              \
} while (0)
#endif
/* A ROWS x 64 tile of format 2: xp [ROWS, Kd2] the rows' bf16 pairs. */
#define DP_TILE(NAME, ROWS)                                                                            \
static void NAME(const uint32_t *xp, int64_t Kd2, const uint16_t *panel, int64_t C, int64_t c0,          \
                 int64_t valid, const float *bias, float *out) {                                      \
    __m512 acc[ROWS][4];                                                                               \
    for (int i = 0; i < ROWS; i++)                                                                     \
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();                                  \
    for (int64_t k = 0; k < Kd2; k++) {                                                                \
        __m512i wv[4];                                                                                 \
        for (int v = 0; v < 4; v++) wv[v] = _mm512_loadu_si512(panel + (k * PANEL + 16 * v) * 2);      \
        for (int i = 0; i < ROWS; i++) {                                                               \
            const uint32_t pair = xp[i * Kd2 + k];                                                     \
            for (int v = 0; v < 4; v++) DP_PAIR(acc[i][v], pair, wv[v]);                               \
        }                                                                                              \
    }                                                                                                  \
    STORE_TILE(ROWS)                                                                                   \
}
DP_TILE(dp_tile_4x64, 4)
DP_TILE(dp_tile_3x64, 3)
DP_TILE(dp_tile_2x64, 2)
DP_TILE(dp_tile_1x64, 1)
#endif

/* Panels [p_begin, p_end) of a format-2 product, rows in chunks of ROUNDED_ROWS rounded once each. */
#define ROUNDED_ROWS 16
KERNEL_PRIVATE void matmul_panels_bf16_math(const float *x, int64_t N, int64_t Kd, const uint16_t *packed,
                                            int64_t C, int64_t p_begin, int64_t p_end, const float *bias, float *out) {
    const int64_t Kd2 = (Kd + 1) / 2;
    uint32_t xp[ROUNDED_ROWS * Kd2];
    for (int64_t t0 = 0; t0 < N; t0 += ROUNDED_ROWS) {
        const int64_t rows = N - t0 < ROUNDED_ROWS ? N - t0 : ROUNDED_ROWS;
        bf16_rows(x + t0 * Kd, rows, Kd, Kd2, (uint16_t *)xp);
        for (int64_t p = p_begin; p < p_end; p++) {
            const uint16_t *panel = packed + p * Kd2 * 2 * PANEL;
            const int64_t c0 = p * PANEL, valid = C - c0 < PANEL ? C - c0 : PANEL;
            float *o = out + t0 * C;
#if defined(__AVX512F__)
            TILE_ROWS(dp_tile, xp, Kd2, Kd2, panel, rows, o);
#else
            for (int64_t t = 0; t < rows; t++) {
                const uint16_t *xr = (const uint16_t *)(xp + t * Kd2);
                for (int64_t c = 0; c < valid; c++) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < Kd2; k++) {
                        const uint16_t *w = panel + (k * PANEL + c) * 2;
                        acc = fmaf(bf16_value(xr[2 * k + 1]), bf16_value(w[1]), acc);
                        acc = fmaf(bf16_value(xr[2 * k]), bf16_value(w[0]), acc);
                    }
                    o[t * C + c0 + c] = acc + (bias ? bias[c0 + c] : 0.0f);
                }
            }
#endif
        }
    }
}

/* 1 when this build multiplies bf16 pairs in one instruction (VDPBF16PS): bf16 arithmetic then does
   twice the products per instruction; without it, format 2 is emulated at float32's speed. */
int bf16_dot_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#define PROBE_CHAINS 16  /* independent accumulators, as a 4 x 64 tile keeps: throughput, not latency */

/* `reps` rounds of one instruction on each of PROBE_CHAINS accumulators -> nanoseconds taken. */
__attribute__((noinline)) static int64_t probe_rounds(int bf16, int64_t reps, volatile float *sink) {
    __m512 acc[PROBE_CHAINS];
    for (int i = 0; i < PROBE_CHAINS; i++) acc[i] = _mm512_set1_ps(*sink + (float)i);  /* distinct: no chain folds */
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    const __m512bh pa = (__m512bh)_mm512_set1_epi32(0x3f803f80), pb = (__m512bh)_mm512_set1_epi32(0x33803380);
    const int64_t started = monotonic_ns();
    if (bf16) {
        for (int64_t r = 0; r < reps; r++)
#pragma GCC unroll 16
            for (int i = 0; i < PROBE_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], pa, pb);
    } else {
        for (int64_t r = 0; r < reps; r++)
#pragma GCC unroll 16
            for (int i = 0; i < PROBE_CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    }
    const int64_t taken = monotonic_ns() - started;
    __m512 total = acc[0];
    for (int i = 1; i < PROBE_CHAINS; i++) total = _mm512_add_ps(total, acc[i]);
    *sink = _mm512_reduce_add_ps(total);  /* the sums are read: the loops cannot be dropped */
    return taken;
}
#endif

/* How many times more products per second this CPU computes with VDPBF16PS (32 per instruction) than
   with float32 FMAs (16), on independent accumulators -> ~2 where the instruction issues as often as an
   FMA (AMD Zen 4), ~0.5 where it issues at a quarter of the FMA's rate (seen on a 2-core Intel Xeon
   without AMX: bf16 arithmetic there only rounds the inputs and runs slower); 0 without the instruction.
   The best of five interleaved rounds of each (a few milliseconds), so a busy core skews neither side. */
double bf16_dot_speedup(void) {
#if defined(__AVX512BF16__)
    volatile float sink = 1.0f;
    int64_t fma = INT64_MAX, dp = INT64_MAX;
    for (int round = 0; round < 5; round++) {
        const int64_t f = probe_rounds(0, 20000, &sink), d = probe_rounds(1, 20000, &sink);
        if (f < fma) fma = f;
        if (d < dp) dp = d;
    }
    return dp > 0 ? 2.0 * (double)fma / (double)dp : 0.0;
#else
    return 0.0;
#endif
}
