/* Sampled requests' tokens from the target's logits, in C (see library.py's Kernels.sample_rows and
   Kernels.accept_drafts): what spec/sampling.py's target_probs, sample and accept compute in a dozen
   torch and numpy calls a row, in a few passes over each row and no full sort.

   A row's target distribution takes the settings in that code's order (HF's): the temperature; top-k
   (every logit below the k-th largest dropped, ties to it kept); the softmax; top-p (the smallest set of
   likeliest tokens whose mass reaches top_p, the top token always kept, and every token tied with its
   least likely member). A token is drawn by the inverse CDF of one uniform over the vocabulary in its
   order. The same tokens and the same rules, but not the same rounding: exp and the sums are this
   file's, so a probability can differ from torch's in its last bits, and a uniform within that of a
   boundary between two tokens (or of a draft's acceptance threshold) may go the other way. */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The float of an int32 key, keys ordered as their floats (-0 just below +0; a non-negative float's key
   is its bits, a negative one's its bits with all but the sign flipped): a search over the keys is a
   search over the floats in order, 32 halvings from any float to any other. */
static float key_float(int32_t key) {
    const int32_t bits = key >= 0 ? key : key ^ INT32_MAX;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* How many of a[0..n) are >= v: one branch-free pass (16 lanes at a time where the build has AVX-512).
   The k-th value's search calls it 32 times, which beat a quickselect's unpredictable branches several
   times over on a 4,096-token row. */
static int64_t count_at_least(const float *a, int64_t n, float v) {
    int64_t count = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 vv = _mm512_set1_ps(v);
    for (; i + 16 <= n; i += 16) count += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), vv, _CMP_GE_OQ));
#endif
    for (; i < n; i++) count += a[i] >= v;
    return count;
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
   reaches top_p of the total (the least of e where the whole row stays below it by rounding). A radix
   select: one pass sums the weights by their top bits (a non-negative float's bits order it), the
   buckets from the heaviest down find the one where the mass is reached, and only that bucket's few
   weights are sorted. scratch [n]. */
#define CUTOFF_SHIFT 19  /* floats in [0, 1] fall in 0x3F800000 >> 19 + 1 = 2,033 buckets */
#define CUTOFF_BUCKETS ((0x3F800000 >> CUTOFF_SHIFT) + 1)

static int64_t cutoff_bucket(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    const int64_t bucket = bits >> CUTOFF_SHIFT;
    return bucket < CUTOFF_BUCKETS ? bucket : CUTOFF_BUCKETS - 1;  /* (a weight past 1 or a NaN: the top one) */
}

static int heavier_first(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static float top_p_cutoff(const float *e, int64_t n, double top_p, double total, float *scratch) {
    const double reach = top_p * total;
    double mass[CUTOFF_BUCKETS] = {0};
    float least = INFINITY;
    for (int64_t i = 0; i < n; i++) {
        mass[cutoff_bucket(e[i])] += e[i];
        least = e[i] < least ? e[i] : least;
    }
    double above = 0.0;
    int64_t bucket = CUTOFF_BUCKETS - 1;
    for (; bucket >= 0 && above + mass[bucket] < reach; bucket--) above += mass[bucket];
    if (bucket < 0) return least;  /* (the whole row stays below: every weight is kept) */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (cutoff_bucket(e[i]) == bucket) scratch[m++] = e[i];
    qsort(scratch, (size_t)m, sizeof(float), heavier_first);
    for (int64_t j = 0; j < m; j++) {
        above += scratch[j];
        if (above >= reach) return scratch[j];
    }
    return scratch[m - 1];  /* (rounding: the bucket's sum in another order fell short by a last bit) */
}

/* The greatest of a[0..n) (n >= 1), 16 lanes at a time where the build has AVX-512. */
static float greatest(const float *a, int64_t n) {
    float top = a[0];
    int64_t i = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 m = _mm512_loadu_ps(a);
        for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(a + i));
        top = _mm512_reduce_max_ps(m);
    }
#endif
    for (; i < n; i++) top = a[i] > top ? a[i] : top;
    return top;
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

/* One row's target weights: logits [V] -> e [V], the row's probabilities up to one factor, after the
   temperature, top-k, the softmax and top-p (a dropped token's exactly 0) -> their total; scratch [V]. */
static double target_weights(const float *logits, int64_t V, float temperature, int64_t top_k, float top_p,
                             float *e, float *scratch) {
    for (int64_t i = 0; i < V; i++) e[i] = logits[i] / temperature;
    if (top_k > 0 && top_k < V) {
        const float kth = kth_largest(e, V, top_k);
        for (int64_t i = 0; i < V; i++) e[i] = e[i] < kth ? -INFINITY : e[i];
    }
    double total = exp_shifted(e, V, greatest(e, V));
    if (top_p < 1.0f) {  /* every token less likely than the cutoff dropped */
        const float cutoff = top_p_cutoff(e, V, top_p, total, scratch);
        double kept = 0.0;
        for (int64_t i = 0; i < V; i++) {
            e[i] = e[i] < cutoff ? 0.0f : e[i];
            kept += e[i];
        }
        total = kept;
    }
    return total;
}

/* The inverse-CDF draw over weights w [V] (>= 0, summing to total > 0): the first token whose cumulative
   weight exceeds u times the total; rounding can leave u * total at the total: then the last token with
   weight. */
static int64_t draw(const float *w, int64_t V, double total, float u) {
    const double target = (double)u * total;
    double cumulative = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 64 <= V; i += 64) {  /* whole blocks of 64 skipped by their sums while the target lies past them */
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(w + i + 16)),
                                       _mm512_add_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(w + i + 48)));
        const double block = _mm512_reduce_add_ps(s);
        if (cumulative + block > target) break;
        cumulative += block;
    }
#endif
    for (; i < V; i++) {
        cumulative += w[i];
        if (w[i] > 0.0f && cumulative > target) return i;
    }
    for (i = V - 1; i > 0 && w[i] <= 0.0f; i--) {}
    return i;
}

/* One row: logits [V] -> the token the uniform u in [0, 1) picks; scratch [2 V]. */
KERNEL_PRIVATE int64_t sample_row(const float *logits, int64_t V, float temperature, int64_t top_k, float top_p,
                                  float u, float *scratch) {
    const double total = target_weights(logits, V, temperature, top_k, top_p, scratch, scratch + V);
    return draw(scratch, V, total, u);
}

/* n rows of logits [n, V] -> tokens [n], row r drawn with uniforms[r] (temperature > 0; top_k 0 = off;
   top_p in (0, 1], 1 = off). Returns 0; 1 when scratch could not be allocated (nothing written). */
int sample_rows(const float *logits, int64_t n, int64_t V, float temperature, int64_t top_k, float top_p,
                const float *uniforms, int64_t *tokens) {
    float *scratch = malloc((size_t)(2 * V) * sizeof(float));
    if (!scratch) return 1;
    for (int64_t r = 0; r < n; r++)
        tokens[r] = sample_row(logits + r * V, V, temperature, top_k, top_p, uniforms[r], scratch);
    free(scratch);
    return 0;
}

/* The verdict on k drafts of a sampled request, spec/sampling.py's accept: logits [k + 1, V] the
   target's rows of the window, drafts [k] their tokens, q [k, V] the distributions they were drawn from,
   uniforms [k + 1] (one per draft's test, then the next token's draw). Draft i passes its test when
   u_i q_i(x_i) < p_i(x_i), p_i the row's target distribution (accepted [k] every draft's test, as accept
   reports them); n, the drafts accepted, is the first that fails (k if none). The next token is drawn
   from norm(max(0, p_n - q_n)) after a rejection (from p_n if no mass is left), from p_k when all pass.
   Returns n; -1 when scratch could not be allocated (nothing written). */
int64_t accept_drafts(const float *logits, int64_t k, int64_t V, float temperature, int64_t top_k, float top_p,
                      const int64_t *drafts, const float *q, const float *uniforms, uint8_t *accepted,
                      int64_t *token) {
    float *p = malloc((size_t)(3 * V) * sizeof(float)), *kept = p + V, *scratch = p + 2 * V;  /* a row's p; p_n */
    if (!p) return -1;
    int64_t n = k;
    double kept_total = 0.0;
    for (int64_t i = 0; i < k; i++) {
        const double total = target_weights(logits + i * V, V, temperature, top_k, top_p, p, scratch);
        const float px = (float)(p[drafts[i]] / total);
        accepted[i] = uniforms[i] * q[i * V + drafts[i]] < px;
        if (!accepted[i] && n == k) {
            n = i;
            for (int64_t j = 0; j < V; j++) {
                kept[j] = (float)(p[j] / total);
                kept_total += kept[j];
            }
        }
    }
    if (n == k) {
        const double total = target_weights(logits + k * V, V, temperature, top_k, top_p, p, scratch);
        *token = draw(p, V, total, uniforms[k]);
    } else {
        double rest = 0.0;
        for (int64_t j = 0; j < V; j++) {
            const float r = kept[j] - q[n * V + j];
            p[j] = r > 0.0f ? r : 0.0f;
            rest += p[j];
        }
        *token = rest > 0.0 ? draw(p, V, rest, uniforms[k]) : draw(kept, V, kept_total, uniforms[k]);
    }
    free(p);
    return n;
}
