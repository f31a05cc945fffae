/* A token drawn from a row of logits under a request's sampling settings, sample_rows (see library.py's
   Kernels.sample_rows): what spec/sampling.py's target_probs then sample compute in a dozen torch and
   numpy calls, in one pass over the row and no sort.

   The settings are applied in that code's order (HF's): the temperature; top-k (every logit below the
   k-th largest dropped, ties to it kept); the softmax; top-p (the smallest set of likeliest tokens
   whose mass reaches top_p, the top token always kept, and every token tied with its least likely
   member); then the inverse-CDF draw of one uniform over the vocabulary in its order. The same tokens
   and the same order of summation where it matters, but not the same rounding: exp and the sums are
   this file's, so a probability can differ from torch's in its last bits, and a uniform within that
   of a boundary between two tokens may pick the other one. */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Floats in the order of an int32 key (-0 just below +0), and back: a search over the keys is a search
   over the floats in order, 32 halvings from any float to any other. */
static int32_t float_key(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits >= 0 ? bits : bits ^ INT32_MAX;
}

static float key_float(int32_t key) {
    const int32_t bits = key >= 0 ? key : key ^ INT32_MAX;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* How many of a[0..n) are >= v; the mass of those > v. One branch-free pass each (16 lanes at a time
   where the build has AVX-512): a search calls them ~32 times, which beat a quickselect's
   unpredictable branches several times over on a 4,096-token row. */
static int64_t count_at_least(const float *a, int64_t n, float v) {
    int64_t count = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 vv = _mm512_set1_ps(v);
    for (; i + 16 <= n; i += 16) count += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), vv, _CMP_GE_OQ));
#endif
    for (; i < n; i++) count += a[i] >= v;
    return count;
}

static double mass_above(const float *a, int64_t n, float v) {
    double mass = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vv = _mm512_set1_ps(v);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 64 <= n; i += 64)  /* (four sums: more adds in flight than one chain allows) */
        for (int j = 0; j < 4; j++) {
            const __m512 x = _mm512_loadu_ps(a + i + 16 * j);
            sum[j] = _mm512_mask_add_ps(sum[j], _mm512_cmp_ps_mask(x, vv, _CMP_GT_OQ), sum[j], x);
        }
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(a + i);
        sum[0] = _mm512_mask_add_ps(sum[0], _mm512_cmp_ps_mask(x, vv, _CMP_GT_OQ), sum[0], x);
    }
    mass = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
#endif
    for (; i < n; i++) mass += a[i] > v ? a[i] : 0.0f;
    return mass;
}

/* The k-th largest of a[0..n) (1 <= k <= n, no NaN): the greatest key whose float has at least k of
   a at or above it (the float of that key is then one of a's values). */
static float kth_largest(const float *a, int64_t n, int64_t k) {
    int64_t lo = INT32_MIN, hi = INT32_MAX;  /* count(>= key_float(lo)) >= k; the answer is in [lo, hi] */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (count_at_least(a, n, key_float((int32_t)mid)) >= k) lo = mid;
        else hi = mid - 1;
    }
    return key_float((int32_t)lo);
}

/* The least weight top-p keeps among e[0..n) (weights >= 0, at most 1, summing to total): the least
   value x of e with mass(> x) < top_p * total, i.e. the J-th heaviest, J the first count whose mass
   reaches top_p of the total (the least of e where the whole row stays below it by rounding). The
   least key v with mass(> v) below that first, then the least value of e at or above it. */
static float top_p_cutoff(const float *e, int64_t n, double top_p, double total) {
    const double reach = top_p * total;
    int32_t lo = 0, hi = float_key(1.0f);  /* mass(> 1) = 0: the answer is in [lo, hi] */
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (mass_above(e, n, key_float(mid)) < reach) hi = mid;
        else lo = mid + 1;
    }
    const float v = key_float(lo);
    float least = INFINITY;
    for (int64_t i = 0; i < n; i++) least = e[i] >= v && e[i] < least ? e[i] : least;
    return least;
}

/* e[i] = exp(e[i] - top) in place, exactly 0 for a dropped logit (-inf) -> their sum. 16 lanes at a time
   with exp512 where the build has AVX-512 (the scalar expf over a 4,096-token row took ~25 us). */
static double exp_shifted(float *e, int64_t V, float top) {
    double total = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 shift = _mm512_set1_ps(top), dropped = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= V; i += 16) {
        const __m512 x = _mm512_loadu_ps(e + i);
        const __m512 y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, dropped, _CMP_GT_OQ),
                                             exp512(_mm512_sub_ps(x, shift)));
        _mm512_storeu_ps(e + i, y);
        sum = _mm512_add_ps(sum, y);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; i < V; i++) {
        e[i] = expf(e[i] - top);
        total += e[i];
    }
    return total;
}

/* One row: logits [V] -> the token the uniform u in [0, 1) picks; scratch [V]. */
KERNEL_PRIVATE int64_t sample_row(const float *logits, int64_t V, float temperature, int64_t top_k, float top_p,
                                  float u, float *scratch) {
    float *e = scratch;
    for (int64_t i = 0; i < V; i++) e[i] = logits[i] / temperature;
    if (top_k > 0 && top_k < V) {
        const float kth = kth_largest(e, V, top_k);
        for (int64_t i = 0; i < V; i++) e[i] = e[i] < kth ? -INFINITY : e[i];
    }
    float top = e[0];
    for (int64_t i = 1; i < V; i++) top = e[i] > top ? e[i] : top;
    double total = exp_shifted(e, V, top);
    if (top_p < 1.0f) {  /* every token less likely than the cutoff dropped */
        const float cutoff = top_p_cutoff(e, V, top_p, total);
        double kept = 0.0;
        for (int64_t i = 0; i < V; i++) {
            e[i] = e[i] < cutoff ? 0.0f : e[i];
            kept += e[i];
        }
        total = kept;
    }
    /* The first token whose cumulative mass exceeds u times the total; rounding can leave u * total at
       the total: then the last token with mass. */
    const double target = (double)u * total;
    double cumulative = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < V; i++) {
        if (e[i] <= 0.0f) continue;
        cumulative += e[i];
        if (cumulative > target) return i;
        last = i;
    }
    return last;
}

/* n rows of logits [n, V] -> tokens [n], row r drawn with uniforms[r] (temperature > 0; top_k 0 = off;
   top_p in (0, 1], 1 = off). Returns 0; 1 when scratch could not be allocated (nothing written). */
int sample_rows(const float *logits, int64_t n, int64_t V, float temperature, int64_t top_k, float top_p,
                const float *uniforms, int64_t *tokens) {
    float *scratch = malloc((size_t)V * sizeof(float));
    if (!scratch) return 1;
    for (int64_t r = 0; r < n; r++)
        tokens[r] = sample_row(logits + r * V, V, temperature, top_k, top_p, uniforms[r], scratch);
    free(scratch);
    return 0;
}
