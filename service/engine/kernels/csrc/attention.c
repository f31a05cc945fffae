/* A decoder layer's attention sub-block, attention_block: see attention.py. */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Rotate one head in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. */
static void rope(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        x[d] = a * c[d] - b * s[d];
        x[d + half] = b * c[d + half] + a * s[d + half];
    }
}

/* o[0:n] += w * v[0:n] */
static void axpy(float *o, float w, const float *v, int64_t n) {
    for (int64_t d = 0; d < n; d++) o[d] += w * v[d];
}

/* Key j of a token's sequence: row j of its slot below `split`, row tail[j - split] from there on (a
   draft tree's node reads its ancestors' rows, see attention.py; a chain's split lies past its last key). */
#define KEY_ROW(j, split, tail) ((j) < (split) ? (j) : (tail)[(j) - (split)])

/* One query head of one token over its sequence's keys and values 0..last: softmax(q k^T * scale) v.
   scores: room for last + 16 floats. */
static void attend_scalar(const float *q, const float *keys, const float *values, int64_t last, int64_t split,
                          const int64_t *tail, int64_t D, float scale, float *scores, float *o) {
    float top = -INFINITY;
    for (int64_t j = 0; j <= last; j++) {
        scores[j] = dot(q, keys + KEY_ROW(j, split, tail) * D, D) * scale;
        if (scores[j] > top) top = scores[j];
    }
    float total = 0.0f;
    for (int64_t j = 0; j <= last; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    memset(o, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j <= last; j++) axpy(o, scores[j], values + KEY_ROW(j, split, tail) * D, D);
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

#if defined(__AVX512F__)
/* Lane i = the sum of v[i]'s 16 lanes, for 16 vectors at once: a transposing tree of adds (45 shuffles
   and adds for 16 sums, against ~8 dependent ones per sum for a horizontal reduction each). Lane
   4q + r of the tree holds key q + 4r; `key_order` puts them back. Its first stage (`sum16_pair`, keys
   2i and 2i + 1) runs as soon as a pair of keys is scored, so only 8 vectors per query stay live. */
static inline __m512 sum16_pair(__m512 v0, __m512 v1) {  /* 128-bit quarters [v0: 0+2, 1+3 | v1: 0+2, 1+3] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
}

static inline __m512 sum16_finish(const __m512 a[8]) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++)  /* quarter j: the 4 partial sums of vector 4i + j */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* quarter j: [8i + j, 8i + j + 4] twice */
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
    const __m512i key_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(key_order, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));
}

/* attend_scalar for NQ (1 or 2) query heads that share one kv head (a GQA group), head dim a multiple
   of 16, 16 keys at a time: their 16 scores from one tree of adds, e^x for 16 scores at once (exp512),
   and the weighted values summed in registers, 64 dims at a time. The heads share each key and value
   load, and their independent sums keep more FMAs in flight; each head's arithmetic is exactly the one
   it has alone (a fixed order of operations per token and head, as everywhere here). */
static inline __attribute__((always_inline)) void attend_heads(
        const int NQ, const float *const q[], const float *keys, const float *values, int64_t last, int64_t split,
        const int64_t *tail, int64_t D, float scale, float *const scores[], float *const o[]) {
    const int64_t n = last + 1;
    const __m512 scale_v = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 top[2] = {minus_inf, minus_inf};
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512 pairs[2][8];
        for (int64_t i = 0; i < 16; i += 2) {
            __m512 s[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
            for (int u = 0; u < 2; u++)
                if (i + u < m)  /* (keys past the last are not read: they may lie past the slot) */
                    for (int64_t d = 0; d < D; d += 16) {
                        const __m512 k = _mm512_loadu_ps(keys + KEY_ROW(j0 + i + u, split, tail) * D + d);
                        for (int h = 0; h < NQ; h++) s[h][u] = _mm512_fmadd_ps(_mm512_loadu_ps(q[h] + d), k, s[h][u]);
                    }
            for (int h = 0; h < NQ; h++) pairs[h][i / 2] = sum16_pair(s[h][0], s[h][1]);
        }
        const __mmask16 keep = m == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
        for (int h = 0; h < NQ; h++) {
            const __m512 sc = _mm512_mask_blend_ps(keep, minus_inf, _mm512_mul_ps(sum16_finish(pairs[h]), scale_v));
            top[h] = _mm512_max_ps(top[h], sc);
            _mm512_storeu_ps(scores[h] + j0, sc);
        }
    }
    __m512 inv[2];
    for (int h = 0; h < NQ; h++) {
        const __m512 top_v = _mm512_set1_ps(_mm512_reduce_max_ps(top[h]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t m = n - j0 < 16 ? n - j0 : 16;
            const __mmask16 keep = m == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
            const __m512 e = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(_mm512_loadu_ps(scores[h] + j0), top_v)));
            total = _mm512_add_ps(total, e);
            _mm512_storeu_ps(scores[h] + j0, e);
        }
        inv[h] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    }
    for (int64_t d = 0; d < D; d += 64) {  /* four independent accumulator chains per key and head */
        const int64_t parts = D - d >= 64 ? 4 : (D - d) / 16;
        __m512 acc[2][4];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) acc[h][i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *v = values + KEY_ROW(j, split, tail) * D + d;
            for (int i = 0; i < parts; i++) {
                const __m512 vi = _mm512_loadu_ps(v + 16 * i);
                for (int h = 0; h < NQ; h++) acc[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h][j]), vi, acc[h][i]);
            }
        }
        for (int h = 0; h < NQ; h++)
            for (int64_t i = 0; i < parts; i++) _mm512_storeu_ps(o[h] + d + 16 * i, _mm512_mul_ps(acc[h][i], inv[h]));
    }
}

/* The query heads [h0, h1) of one GQA group (one kv head: keys, values) for one token, two at a time. */
static void attend_group(const float *q, int64_t h0, int64_t h1, const float *keys, const float *values, int64_t last,
                         int64_t split, const int64_t *tail, int64_t D, float scale, float *scores0, float *scores1,
                         float *o) {
    for (int64_t h = h0; h < h1; h += 2) {
        if (D % 16) {
            attend_scalar(q + h * D, keys, values, last, split, tail, D, scale, scores0, o + h * D);
            if (h + 1 < h1)
                attend_scalar(q + (h + 1) * D, keys, values, last, split, tail, D, scale, scores0, o + (h + 1) * D);
        } else if (h + 1 < h1) {
            const float *qs[2] = {q + h * D, q + (h + 1) * D};
            float *const sc[2] = {scores0, scores1}, *const os[2] = {o + h * D, o + (h + 1) * D};
            attend_heads(2, qs, keys, values, last, split, tail, D, scale, sc, os);
        } else {
            const float *qs[1] = {q + h * D};
            float *const sc[1] = {scores0}, *const os[1] = {o + h * D};
            attend_heads(1, qs, keys, values, last, split, tail, D, scale, sc, os);
        }
    }
}
#else
/* Portable: each head alone. */
static void attend_group(const float *q, int64_t h0, int64_t h1, const float *keys, const float *values, int64_t last,
                         int64_t split, const int64_t *tail, int64_t D, float scale, float *scores0, float *scores1,
                         float *o) {
    (void)scores1;
    for (int64_t h = h0; h < h1; h++)
        attend_scalar(q + h * D, keys, values, last, split, tail, D, scale, scores0, o + h * D);
}
#endif

struct attention_args {
    const float *x; int64_t N, H; const float *norm_w; float eps; const void *qkv_wt; const float *qkv_b;
    int64_t A, K, D; const float *rope_cos, *rope_sin; const int64_t *positions, *slots, *tree;
    float *k_cache, *v_cache;
    int64_t S; const void *o_wt; int fmt; float *hn, *qkv, *att, *out; int kv_only;
};

/* Where token t sits in its sequence: its rope position; and the key rows it attends: rows 0..*last, of
   which rows from *split on are tail[] (its path's cache rows). A chain token reads rows 0..position
   (split past them). A tree node's record in `tree` (see attention.py) is [d, b, r1, .., rd]: its path
   from its window's first token (row b) to itself (row rd, its position); it is roped at b + d and
   reads b prefix rows, then its path's d + 1 rows as keys b..b + d: exactly what decoding its path as
   a chain would read, key for key in the same order, so bitwise the same result. */
static int64_t token_keys(const struct attention_args *a, int64_t t, const int64_t **tail, int64_t *last,
                          int64_t *split) {
    if (!a->tree) {
        *last = a->positions[t], *split = a->positions[t] + 1, *tail = NULL;
        return a->positions[t];
    }
    const int64_t *record = a->tree + a->tree[t], depth = record[0], base = record[1];
    *last = base + depth, *split = base, *tail = record + 1;
    return base + depth;
}

/* Token t's kv head g: rope on its query heads (unless skip_q) and its key head, then its key and value
   into the cache at its own row (its position). Each head's rope is its own, so any order of (t, g)
   gives the same bits. */
static void rope_and_store_group(const struct attention_args *a, int64_t t, int64_t g, int skip_q) {
    const int64_t D = a->D, K = a->K, Q = a->A * D, R = (a->A + 2 * K) * D, group = a->A / K, pos = a->positions[t];
    float *row = a->qkv + t * R;
    const int64_t *tail;
    int64_t last, split;  /* (the rows it attends are attend_units' concern) */
    const int64_t at_rope = token_keys(a, t, &tail, &last, &split);
    const float *c = a->rope_cos + at_rope * D, *s = a->rope_sin + at_rope * D;
    for (int64_t h = g * group; !skip_q && h < (g + 1) * group; h++) rope(row + h * D, c, s, D / 2);
    rope(row + Q + g * D, c, s, D / 2);
    const int64_t at = ((a->slots[t] * K + g) * a->S + pos) * D;
    memcpy(a->k_cache + at, row + Q + g * D, (size_t)D * sizeof(float));
    memcpy(a->v_cache + at, row + Q + (K + g) * D, (size_t)D * sizeof(float));
}

/* Phase 1 for tokens [begin, end): norm, q/k/v, rope, and k and v into the cache (kv_only: k and v
   alone, when the query columns fill whole panels; the same arithmetic for each of them). */
static void attention_project_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_args *a = ctx;
    const int64_t H = a->H, Q = a->A * a->D, R = (a->A + 2 * a->K) * a->D, n = end - begin;
    const int skip_q = a->kv_only && Q % PANEL == 0;
    rms_norm(a->x + begin * H, n, H, a->norm_w, a->eps, a->hn + begin * H);
    matmul_panels(a->hn + begin * H, n, H, a->qkv_wt, a->fmt, R, skip_q ? Q / PANEL : 0, (R + PANEL - 1) / PANEL,
                  a->qkv_b, a->qkv + begin * R);
    for (int64_t t = begin; t < end; t++)
        for (int64_t g = 0; g < a->K; g++) rope_and_store_group(a, t, g, skip_q);
}

/* One token's query heads of one kv head (unit = token * K + kv head): softmax(q k^T / sqrt(D)) v. */
static void attend_units(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_args *a = ctx;
    const int64_t D = a->D, K = a->K, Q = a->A * D, R = (a->A + 2 * K) * D, group = a->A / K;
    const float scale = 1.0f / sqrtf((float)D);
    float scores0[a->S + 16], scores1[a->S + 16];  /* (the vector path rounds the keys up to 16) */
    const int64_t *tail;
    int64_t last, split;
    for (int64_t u = begin; u < end; u++) {
        const int64_t t = u / K, kh = u % K, head = (a->slots[t] * K + kh) * a->S * D;
        token_keys(a, t, &tail, &last, &split);
        attend_group(a->qkv + t * R, kh * group, (kh + 1) * group, a->k_cache + head, a->v_cache + head,
                     last, split, tail, D, scale, scores0, scores1, a->att + t * Q);
    }
}

/* Phase 2 for tokens [begin, end), once every token's keys and values are in: attention, o_proj and
   the residual. */
static void attention_attend_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_args *a = ctx;
    const int64_t H = a->H, Q = a->A * a->D;
    attend_units(ctx, begin * a->K, end * a->K);
    matmul_p(a->att + begin * Q, end - begin, Q, a->o_wt, a->fmt, H, NULL, a->out + begin * H);
    for (int64_t j = begin * H; j < end * H; j++) a->out[j] = a->x[j] + a->out[j];
}

/* A pass of a few tokens (one request's decode or verify step) split by kv head and output columns
   instead of by token: each panel of the two projections is read by one thread, where a token split
   would have every thread read all of them (at this model's size the weights come from the shared
   cache, and reading them is most of the sub-block's time). With head dims that fill whole panels a kv
   head's query, key and value columns are panels of their own: a thread projects, ropes, stores and
   attends its groups (group_units), then the output projection splits by panel (o_panels). The same
   products per panel and the same rope and attention per head, so bitwise the token split. */
#define COLUMN_SPLIT_MAX 4

static int splits_by_columns(const struct attention_args *a, const struct kernel_pool *pool) {
    return pool != NULL && a->N <= COLUMN_SPLIT_MAX && !a->kv_only && a->D % PANEL == 0;
}

static void group_units(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_args *a = ctx;
    const int64_t D = a->D, K = a->K, Q = a->A * D, R = Q + 2 * K * D, group = a->A / K, hp = D / PANEL;
    for (int64_t g = begin; g < end; g++) {
        const int64_t q0 = g * group * hp, k0 = (Q + g * D) / PANEL, v0 = (Q + (K + g) * D) / PANEL;
        matmul_panels(a->hn, a->N, a->H, a->qkv_wt, a->fmt, R, q0, q0 + group * hp, a->qkv_b, a->qkv);
        matmul_panels(a->hn, a->N, a->H, a->qkv_wt, a->fmt, R, k0, k0 + hp, a->qkv_b, a->qkv);
        matmul_panels(a->hn, a->N, a->H, a->qkv_wt, a->fmt, R, v0, v0 + hp, a->qkv_b, a->qkv);
        for (int64_t t = 0; t < a->N; t++) rope_and_store_group(a, t, g, 0);
        for (int64_t t = 0; t < a->N; t++) attend_units(ctx, t * K + g, t * K + g + 1);
    }
}

static void o_panels(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_args *a = ctx;
    const int64_t H = a->H, c1 = end * PANEL < H ? end * PANEL : H;
    matmul_panels(a->att, a->N, a->A * a->D, a->o_wt, a->fmt, H, begin, end, NULL, a->out);
    for (int64_t t = 0; t < a->N; t++)
        for (int64_t j = t * H + begin * PANEL; j < t * H + c1; j++) a->out[j] = a->x[j] + a->out[j];
}

/* See attention.py. qkv_wt and o_wt: the [R, H] and [H, A D] projections packed (matmul_p);
   k_cache / v_cache: this layer's [slots, K, S, D]; tree: NULL (chains), or the pass's draft-tree paths (see
   attention.py); scratch: N * (H + R + A D) floats; out [N, H] must
   not alias x; pool: the threads each phase's tokens are split over (NULL: this thread alone; the phases
   are joined in between, so every key is written before any token attends). kv_only: write the keys
   and values and stop (out untouched): a prefill's last layer, whose outputs nothing reads. */
void attention_block(const float *x, int64_t N, int64_t H, const float *norm_w, float eps,
                     const void *qkv_wt, const float *qkv_b, int64_t A, int64_t K, int64_t D, int fmt,
                     const float *rope_cos, const float *rope_sin, const int64_t *positions, const int64_t *slots,
                     const int64_t *tree, float *k_cache, float *v_cache, int64_t S, const void *o_wt,
                     float *scratch, float *out, struct kernel_pool *pool, int kv_only) {
    const int64_t R = (A + 2 * K) * D;
    float *hn = scratch, *qkv = hn + N * H, *att = qkv + N * R;  /* [N, H] [N, R] [N, A D] */
    const struct attention_args a = {x, N, H, norm_w, eps, qkv_wt, qkv_b, A, K, D, rope_cos, rope_sin, positions,
                                     slots, tree, k_cache, v_cache, S, o_wt, fmt, hn, qkv, att, out, kv_only};
    if (splits_by_columns(&a, pool)) {
        rms_norm(x, N, H, norm_w, eps, hn);
        pool_rows(pool, group_units, &a, K);
        pool_rows(pool, o_panels, &a, (H + PANEL - 1) / PANEL);
        return;
    }
    pool_rows(pool, attention_project_rows, &a, N);
    if (!kv_only) pool_rows(pool, attention_attend_rows, &a, N);
}
