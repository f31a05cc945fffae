
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
/* Two independent FMA chains, one tree reduction per dot: most rows here are 64 or 256 long. */
static float dot(const float *a, const float *b, int64_t n) {
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
static float dot(const float *a, const float *b, int64_t n) {
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
static inline __m512 exp512(__m512 x) {
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

/* Weights for the products below are packed in panels (`pack_panels`): a [Kd, C] matrix (a weight
   stored transposed) as ceil(C / 64) panels of [Kd, 64], columns past C zero. A tile then streams one
   contiguous panel (a row-major [Kd, C] read 64 columns at a time jumps C floats per k: for the output
   layer 16 KB, a new page every step, which the hardware prefetchers do not follow).

   out[t, c] = sum over k ascending of x[t, k] * w[k, c] (one fused multiply-add per term, from 0),
   then + bias[c]: x [N, Kd], out [N, C]. Every element takes the same arithmetic whatever N is and
   wherever it falls in a tile, so a row's result never depends on the other rows; tiles of 4 rows x 64
   columns (3, 2 or 1 for the rows left over) reuse each loaded weight vector for every row. */
#define PANEL 64
/* Panel formats (`PackedWeight.format`): float32; bf16 values widened exactly (float32 arithmetic); bf16
   pairs with bf16 arithmetic (below). */
#define PANELS_F32 0
#define PANELS_BF16 1
#define PANELS_BF16_MATH 2
/* A panel's weights are float32, or bfloat16 (bf16 != 0) when the weight holds only bf16 values (the
   shipped checkpoint is bf16): widened to the same float32 on load, exactly, so the product is bitwise
   the one from float32 panels for half the bytes a pass reads. */
static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#define LOAD_F32(p) _mm512_loadu_ps(p)
#define LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* A tile's accumulators acc[ROWS][4] + bias to out (only the `valid` first columns of the panel). */
#define STORE_TILE(ROWS)                                                                               \
    for (int v = 0; v < 4; v++) {                                                                      \
        const int64_t left = valid - 16 * v;                                                           \
        if (left <= 0) break;                                                                          \
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);         \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c0 + 16 * v) : _mm512_setzero_ps(); \
        for (int i = 0; i < ROWS; i++)                                                                 \
            _mm512_mask_storeu_ps(out + i * C + c0 + 16 * v, keep, _mm512_add_ps(acc[i][v], b));       \
    }
/* A ROWS x 64 tile of out from one panel of W-typed weights, its accumulators in registers; only the
   `valid` first columns are stored (the last panel of a C that is not a multiple of 64). */
#define MATMUL_TILE(NAME, ROWS, W, LOAD)                                                               \
static void NAME(const float *x, int64_t Kd, const W *panel, int64_t C, int64_t c0, int64_t valid,      \
                 const float *bias, float *out) {                                                      \
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
/* Rows 0..N of x (a row every XROW elements) through one panel (W, K: the tile's weights and depth):
   tiles PREFIX_4x64 of 4 rows, then one of 3, 2 or 1 for the rows left over; needs C, c0, valid and
   bias in scope. 2- and 3-row tiles: in a batched step most experts serve 1-3 positions, which would
   otherwise reload each weight vector once per row. */
#define TILE_ROWS(PREFIX, X, XROW, K, W, N, OUT)                                                       \
    do {                                                                                               \
        int64_t t_ = 0;                                                                                \
        for (; t_ + 4 <= (N); t_ += 4) PREFIX##_4x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 3) PREFIX##_3x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 2) PREFIX##_2x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 1) PREFIX##_1x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
    } while (0)
MATMUL_TILE(f32_tile_4x64, 4, float, LOAD_F32)
MATMUL_TILE(f32_tile_3x64, 3, float, LOAD_F32)
MATMUL_TILE(f32_tile_2x64, 2, float, LOAD_F32)
MATMUL_TILE(f32_tile_1x64, 1, float, LOAD_F32)
MATMUL_TILE(bf16_tile_4x64, 4, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_3x64, 3, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_2x64, 2, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_1x64, 1, uint16_t, LOAD_BF16)
#endif

