/* The MoE kernels, swiglu_experts and moe_block: see moe.py. */
#include "kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* act[i] = r * silu(g[i]) * u[i] for i < I (SiLU(g) = g / (1 + e^-g)). */
KERNEL_PRIVATE void swiglu_act(const float *g, const float *u, float r, int64_t I, float *act) {
#if defined(__AVX512F__)
    const __m512 rv = _mm512_set1_ps(r), one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < I; i += 16) {  /* the last lanes masked: every element takes the same path */
        const __mmask16 keep = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
        const __m512 gv = _mm512_maskz_loadu_ps(keep, g + i), uv = _mm512_maskz_loadu_ps(keep, u + i);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(act + i, keep, _mm512_mul_ps(_mm512_mul_ps(rv, silu), uv));
    }
#else
    for (int64_t i = 0; i < I; i++) act[i] = r * (g[i] / (1.0f + expf(-g[i]))) * u[i];
#endif
}

/* Positions per tile pass through one expert: the scratch below lives on the stack (~80 KB for the
   shipped model's shared expert), and an expert's weights stay in L2 across the chunks of a long pass. */
#define ROW_CHUNK 16

/* One expert over up to ROW_CHUNK gathered positions: y[q] = down^T (r[q] silu(g) * u), [g | u] =
   x_{rows[q]} gate_up^T, y [np, H]. Every product is matmul_p's, so each row's arithmetic is its own. */
static void expert_apply(const float *x, int64_t H, int64_t I, const void *gate_up_t, const void *down_t, int fmt,
                         const int64_t *rows, const float *r, int64_t np, float *y) {
    if (np <= 0) return;  /* no positions: nothing to compute, and no unwritten scratch is read */
    float xs[ROW_CHUNK * H], gu[ROW_CHUNK * 2 * I], act[ROW_CHUNK * I];
    for (int64_t q = 0; q < np; q++) memcpy(xs + q * H, x + rows[q] * H, (size_t)H * sizeof(float));
    matmul_p(xs, np, H, gate_up_t, fmt, 2 * I, NULL, gu);
    for (int64_t q = 0; q < np; q++) swiglu_act(gu + q * 2 * I, gu + q * 2 * I + I, r[q], I, act + q * I);
    matmul_p(act, np, I, down_t, fmt, H, NULL, y);
}

/* expert_apply, then out[rows[q]] += y[q]. */
static void expert_rows(const float *x, int64_t H, int64_t I, const void *gate_up_t, const void *down_t, int fmt,
                        const int64_t *rows, const float *r, int64_t np, float *out) {
    float y[ROW_CHUNK * H];
    expert_apply(x, H, I, gate_up_t, down_t, fmt, rows, r, np, y);
    for (int64_t q = 0; q < np; q++) {
        float *o = out + rows[q] * H;
        for (int64_t h = 0; h < H; h++) o[h] += y[q * H + h];
    }
}

/* p + elements weights of the panels' type. */
static const void *weights_at(const void *p, int64_t elements, int fmt) {
    return (const char *)p + elements * (fmt != PANELS_F32 ? 2 : 4);
}

/* Counting sort of the (position, weight) pairs of ids / weights [w, n] by expert, positions ascending
   within an expert: pair slot `at` holds position rows[at] and weight r[at]; slot[j], unless NULL, is
   pair j's slot. Ids outside [0, E) are ignored (slot -1). Afterwards count [E + 1] holds each expert's
   end: expert e's slots are count[e - 1] (0 for e = 0) up to count[e]. */
static void sort_pairs_by_expert(const int64_t *ids, const float *weights, int64_t w, int64_t n, int64_t E,
                                 int64_t *count, int64_t *rows, float *r, int64_t *slot) {
    memset(count, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t j = 0; j < w * n; j++)
        if (ids[j] >= 0 && ids[j] < E) count[ids[j] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    for (int64_t j = 0; j < w * n; j++) {
        const int64_t at = ids[j] >= 0 && ids[j] < E ? count[ids[j]]++ : -1;
        if (at >= 0) {
            rows[at] = j / n;
            r[at] = weights[j];
        }
        if (slot) slot[j] = at;
    }
}

/* gate_up_t / down_t: every expert's packed panels, gate_up_stride / down_stride weights apart; fmt:
   their format (PANELS_*). */
void swiglu_experts(const float *x, int64_t w, int64_t H, int64_t I, const void *gate_up_t,
                    int64_t gate_up_stride, const void *down_t, int64_t down_stride, int fmt, int64_t num_experts,
                    const int64_t *ids, const float *weights, int64_t n, float *out, int accumulate) {
    int64_t count[num_experts + 1];
    int64_t *rows = malloc((size_t)(w * n + 1) * sizeof(int64_t));
    float *r = malloc((size_t)(w * n + 1) * sizeof(float));
    if (!rows || !r) { free(rows); free(r); return; }  /* (the Python side allocates far more than this) */
    if (!accumulate) memset(out, 0, (size_t)(w * H) * sizeof(float));
    sort_pairs_by_expert(ids, weights, w, n, num_experts, count, rows, r, NULL);
    for (int64_t e = 0, first = 0; e < num_experts; first = count[e], e++)
        for (int64_t c = first; c < count[e]; c += ROW_CHUNK)
            expert_rows(x, H, I, weights_at(gate_up_t, e * gate_up_stride, fmt),
                        weights_at(down_t, e * down_stride, fmt), fmt, rows + c, r + c,
                        count[e] - c < ROW_CHUNK ? count[e] - c : ROW_CHUNK, out);
    free(rows);
    free(r);
}

/* A whole Qwen2-MoE block: router (E rows) and shared-expert gate (row E) in one pass, softmax over
   the E router logits, the top m by logit (largest first; softmax keeps the order), routing weights =
   their probabilities (renormalised if norm_topk), the routed experts, then the shared expert scaled by
   sigmoid(its gate). Writes logits [w, E+1], ids [w, m], weights [w, m], out [w, H]. */
struct moe_args {
    const float *x; int64_t H; const float *router; int64_t E, m; int norm_topk;
    const void *gate_up_t; int64_t gate_up_stride; const void *down_t; int64_t down_stride, I;
    const void *shared_gate_up_t, *shared_down_t; int64_t Is; int fmt;
    float *logits; int64_t *ids; float *weights, *out;
    float *scale;  /* [w]: each position's shared-expert scale */
};

/* Routing of positions [begin, end): logits, ids, weights and the shared expert's scale. */
static void moe_route_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct moe_args *a = ctx;
    const int64_t H = a->H, E = a->E, m = a->m;
    unsigned char taken[E];
    for (int64_t p = begin; p < end; p++) {
        const float *xp = a->x + p * H;
        float *l = a->logits + p * (E + 1), *weights = a->weights + p * m;
        int64_t *ids = a->ids + p * m;
        for (int64_t e = 0; e <= E; e++) l[e] = dot(a->router + e * H, xp, H);
        float top = l[0];
        for (int64_t e = 1; e < E; e++) if (l[e] > top) top = l[e];
        float total = 0.0f;
        for (int64_t e = 0; e < E; e++) total += expf(l[e] - top);
        memset(taken, 0, (size_t)E);
        float picked = 0.0f;
        for (int64_t j = 0; j < m; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
            taken[best] = 1;
            ids[j] = best;
            weights[j] = expf(l[best] - top) / total;
            picked += weights[j];
        }
        if (a->norm_topk)
            for (int64_t j = 0; j < m; j++) weights[j] /= picked;
        a->scale[p] = 1.0f / (1.0f + expf(-l[E]));
    }
}

/* Positions [begin, end) whole: their routing, then their experts (each thread reads the experts its
   own positions picked: a long pass, where every thread needs nearly every expert anyway). */
static void moe_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct moe_args *a = ctx;
    const int64_t H = a->H, m = a->m, w = end - begin;
    int64_t zero[w];
    memset(zero, 0, sizeof zero);
    moe_route_rows(ctx, begin, end);
    const float *x = a->x + begin * H;
    float *out = a->out + begin * H;
    swiglu_experts(x, w, H, a->I, a->gate_up_t, a->gate_up_stride, a->down_t, a->down_stride, a->fmt, a->E,
                   a->ids + begin * m, a->weights + begin * m, m, out, 0);
    swiglu_experts(x, w, H, a->Is, a->shared_gate_up_t, 0, a->shared_down_t, 0, a->fmt, 1, zero, a->scale + begin,
                   1, out, 1);
}

/* A short pass (a batched step of many requests) split by expert instead of by position: work units of
   up to ROW_CHUNK positions of one expert (the shared expert's first), taken in turn by each thread, so
   every touched expert is read once per call whoever's positions picked it; each unit writes its rows'
   results apart, and a last phase adds them up per position in ascending expert id and then the
   shared expert's, the same additions in the same order as `moe_rows`: bitwise its result. Measured on
   the 2-core development machine (MoE block calls recorded from real passes, replayed interleaved, 2
   threads, by expert against by position, ms): 8 positions 0.102 / 0.116, 16 0.189-0.202 /
   0.202-0.212, 32 no difference (0.37 both): past 16 every thread's positions need most experts
   anyway, and the results written apart cost their traffic. (1 position 0.035 / 0.052, but see
   KernelThreads: real decoding of one request gained nothing.) */
#define EXPERT_SPLIT_MAX 16
struct moe_unit { int64_t expert, first, count; };  /* expert -1: the shared one, over positions first.. */
struct moe_by_expert {
    const struct moe_args *a;
    const int64_t *rows, *slot, *positions;  /* pair slot -> position; (p, j) -> its slot; 0..w-1 */
    const float *r;                          /* pair slot -> routing weight */
    const struct moe_unit *units;
    int64_t n_units;
    atomic_long next;
    float *y, *y_shared;                     /* [pairs, H], [w, H] */
};

static void moe_units(const void *ctx, int64_t begin, int64_t end) {
    struct moe_by_expert *b = (struct moe_by_expert *)ctx;  /* (only `next` changes) */
    const struct moe_args *a = b->a;
    (void)begin, (void)end;
    for (int64_t u; (u = atomic_fetch_add_explicit(&b->next, 1, memory_order_relaxed)) < b->n_units;) {
        const struct moe_unit *it = &b->units[u];
        if (it->expert < 0)
            expert_apply(a->x, a->H, a->Is, a->shared_gate_up_t, a->shared_down_t, a->fmt, b->positions + it->first,
                         a->scale + it->first, it->count, b->y_shared + it->first * a->H);
        else
            expert_apply(a->x, a->H, a->I, weights_at(a->gate_up_t, it->expert * a->gate_up_stride, a->fmt),
                         weights_at(a->down_t, it->expert * a->down_stride, a->fmt), a->fmt, b->rows + it->first,
                         b->r + it->first, it->count, b->y + it->first * a->H);
    }
}

static void moe_sum_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct moe_by_expert *b = ctx;
    const int64_t H = b->a->H, m = b->a->m;
    int64_t order[m];
    for (int64_t p = begin; p < end; p++) {
        for (int64_t j = 0; j < m; j++) {  /* this position's slots ascending = its experts ascending */
            int64_t i = j, s = b->slot[p * m + j];
            for (; i > 0 && order[i - 1] > s; i--) order[i] = order[i - 1];
            order[i] = s;
        }
        float *o = b->a->out + p * H;
        memset(o, 0, (size_t)H * sizeof(float));
        for (int64_t j = 0; j < m; j++)
            for (int64_t h = 0; h < H; h++) o[h] += b->y[order[j] * H + h];
        for (int64_t h = 0; h < H; h++) o[h] += b->y_shared[p * H + h];
    }
}

/* Returns 0 when it could not allocate its scratch (the caller then runs moe_rows). */
static int moe_block_by_expert(const struct moe_args *a, int64_t w, struct kernel_pool *pool) {
    const int64_t E = a->E, m = a->m, H = a->H, pairs = w * m;
    /* One allocation: rows, slot [pairs] and positions [w]; units; r [pairs], y [pairs, H], y_shared [w, H]. */
    const size_t ints = (size_t)(2 * pairs + w), n_units_max = (size_t)(pairs + w);
    const size_t floats = (size_t)(pairs + (pairs + w) * H);
    char *scratch = malloc(ints * sizeof(int64_t) + n_units_max * sizeof(struct moe_unit) + floats * sizeof(float));
    if (!scratch) return 0;
    int64_t *rows = (int64_t *)scratch, *slot = rows + pairs, *positions = slot + pairs, count[E + 1];
    struct moe_unit *units = (struct moe_unit *)(positions + w);
    float *r = (float *)(units + n_units_max);
    pool_rows(pool, moe_route_rows, a, w);
    sort_pairs_by_expert(a->ids, a->weights, w, m, E, count, rows, r, slot);
    int64_t n = 0;
    for (int64_t p = 0; p < w; p++) positions[p] = p;
    for (int64_t p = 0; p < w; p += ROW_CHUNK)  /* the shared expert first: the biggest units */
        units[n++] = (struct moe_unit){-1, p, w - p < ROW_CHUNK ? w - p : ROW_CHUNK};
    for (int64_t e = 0, first = 0; e < E; first = count[e], e++)
        for (int64_t c = first; c < count[e]; c += ROW_CHUNK)
            units[n++] = (struct moe_unit){e, c, count[e] - c < ROW_CHUNK ? count[e] - c : ROW_CHUNK};
    struct moe_by_expert b = {a, rows, slot, positions, r, units, n, 0, r + pairs, r + pairs + pairs * H};
    const int64_t threads = pool ? pool->workers + 1 : 1;
    pool_rows(pool, moe_units, &b, threads);  /* one range per thread, each taking units until none is left */
    pool_rows(pool, moe_sum_rows, &b, w);
    free(scratch);
    return 1;
}

/* pool: the threads a pass is split over (NULL: this thread alone): a short pass by expert, a long one by
   position (see moe_block_by_expert); either way bitwise the one-thread result. */
void moe_block(const float *x, int64_t w, int64_t H, const float *router, int64_t E, int64_t m, int norm_topk,
               const void *gate_up_t, int64_t gate_up_stride, const void *down_t, int64_t down_stride, int64_t I,
               const void *shared_gate_up_t, const void *shared_down_t, int64_t Is, int fmt,
               float *logits, int64_t *ids, float *weights, float *out, float *scale, struct kernel_pool *pool) {
    const struct moe_args a = {x, H, router, E, m, norm_topk, gate_up_t, gate_up_stride, down_t, down_stride, I,
                               shared_gate_up_t, shared_down_t, Is, fmt, logits, ids, weights, out, scale};
    if (pool != NULL && w <= EXPERT_SPLIT_MAX && moe_block_by_expert(&a, w, pool)) return;
    pool_rows(pool, moe_rows, &a, w);
}
