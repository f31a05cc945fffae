/* The helpers every kernel uses: dot products, e^x, the bf16 widening and the register tiles of the
   products over packed panels (kernels.h declares them and the panels' layout). */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
/* Two independent FMA chains, one tree reduction per dot: most rows here are 64 or 256 long. */
KERNEL_PRIVATE float dot(const float *a, const float *b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), acc1);
    }
    for (; k + 16 <= n; k += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#else
/* Portable: 16 independent partial sums the compiler can keep in SIMD registers without being
   allowed to reorder a single sum (no -ffast-math). */
#define LANES 16
KERNEL_PRIVATE float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#endif

#if defined(__AVX512F__)
/* e^x for 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, then
   2^n by vscalefps): within ~2 ulp of expf, and about 10x faster than glibc's scalar expf, which
   SiLU calls for every intermediate unit of every expert a position picked (a 1,520-token prefill:
   1.2 M calls per layer). Every lane takes the same arithmetic, so results stay row independent. */
KERNEL_PRIVATE inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* A panel's weights are float32, or bfloat16 (bf16 != 0) when the weight holds only bf16 values (the
   shipped checkpoint is bf16): widened to the same float32 on load, exactly, so the product is bitwise
   the one from float32 panels for half the bytes a pass reads. */
KERNEL_PRIVATE inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#define LOAD_F32(p) _mm512_loadu_ps(p)
#define LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* A ROWS x 64 tile of out from one panel of W-typed weights, its accumulators in registers; only the
   `valid` first columns are stored (the last panel of a C that is not a multiple of 64). */
#define MATMUL_TILE(NAME, ROWS, W, LOAD)                                                               \
KERNEL_PRIVATE void NAME(const float *x, int64_t Kd, const W *panel, int64_t C, int64_t c0,            \
                         int64_t valid, const float *bias, float *out) {                               \
    __m512 acc[ROWS][4];                                                                               \
    for (int i = 0; i < ROWS; i++)                                                                     \
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();                                  \
    for (int64_t k = 0; k < Kd; k++) {                                                                 \
        __m512 wv[4];                                                                                  \
        for (int v = 0; v < 4; v++) wv[v] = LOAD(panel + k * PANEL + 16 * v);                          \
        for (int i = 0; i < ROWS; i++) {                                                               \
            const __m512 xb = _mm512_set1_ps(x[i * Kd + k]);                                           \
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xb, wv[v], acc[i][v]);             \
        }                                                                                              \
    }                                                                                                  \
    STORE_TILE(ROWS)                                                                                   \
}
MATMUL_TILE(f32_tile_4x64, 4, float, LOAD_F32)
MATMUL_TILE(f32_tile_3x64, 3, float, LOAD_F32)
MATMUL_TILE(f32_tile_2x64, 2, float, LOAD_F32)
MATMUL_TILE(f32_tile_1x64, 1, float, LOAD_F32)
MATMUL_TILE(bf16_tile_4x64, 4, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_3x64, 3, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_2x64, 2, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_1x64, 1, uint16_t, LOAD_BF16)
#endif

