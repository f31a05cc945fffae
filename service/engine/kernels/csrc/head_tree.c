/* A draft head's top-candidate tree for one sequence in one call: see head.py (head_tree). */
#include "head.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Every child offered while the tree grows. */
struct candidate {
    int64_t token;   /* draft index */
    int64_t parent;  /* candidate index, -1: the root */
    int64_t depth;   /* 1: a child of the root */
    int64_t row;     /* its head-cache row once expanded, else -1 */
    double score;    /* its path's log-probability */
};

struct tree_state {
    struct candidate *c;
    int64_t n;
};

/* log(sum_i exp(logits[i] * inv_tau)) of logits [Vd] whose largest value times inv_tau is top: 16 lanes
   of exp512 at a time where the CPU has them (a tree offers children once per expanded node, and a scalar
   exp over the draft vocabulary cost more than the node's head row). */
static double log_normalizer(const float *logits, int64_t Vd, float inv_tau, float top) {
    float total = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(inv_tau), shift = _mm512_set1_ps(top);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= Vd; i += 16)
        acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(logits + i), scale), shift)));
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < Vd; i++) total += expf(logits[i] * inv_tau - top);
    return (double)top + log((double)total);
}

/* The `width` likeliest draft indices of logits [Vd] at temperature tau, offered as children of `parent`
   with their path scores (log-softmax), best first (ties to the lower index). */
static void offer_children(struct tree_state *t, const float *logits, int64_t Vd, float tau, int64_t width,
                           int64_t parent, double base, int64_t depth) {
    const float inv_tau = 1.0f / tau;
    float top = -INFINITY;
    for (int64_t i = 0; i < Vd; i++)
        if (logits[i] * inv_tau > top) top = logits[i] * inv_tau;
    const double log_total = log_normalizer(logits, Vd, inv_tau, top);
    int64_t best[8];
    int64_t k = 0;
    for (int64_t i = 0; i < Vd; i++) {  /* insertion into the running top-width list */
        int64_t at = k < width ? k : width;
        while (at > 0 && logits[i] > logits[best[at - 1]]) at--;
        if (at >= width) continue;
        for (int64_t j = (k < width ? k : width - 1); j > at; j--) best[j] = best[j - 1];
        best[at] = i;
        if (k < width) k++;
    }
    for (int64_t j = 0; j < k; j++)
        t->c[t->n++] = (struct candidate){best[j], parent, depth, -1, base + logits[best[j]] * inv_tau - log_total};
}

static int by_score(const struct candidate *c, int64_t a, int64_t b) {  /* a before b */
    return c[a].score > c[b].score || (c[a].score == c[b].score && a < b);
}

/* indices [n] sorted best first (insertion sort: a few dozen candidates at most). */
static void sort_by_score(const struct candidate *c, int64_t *idx, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = i; j > 0 && by_score(c, idx[j], idx[j - 1]); j--) {
            const int64_t s = idx[j];
            idx[j] = idx[j - 1], idx[j - 1] = s;
        }
}

/* Catch-up of m entries (as head_draft's) at positions start.. of `slot`, then a tree of at most `budget`
   nodes (see head.py), grown best first: taus [budget] the ranking temperature of each depth. Out: tokens
   [budget] draft indices and parents [budget] (node indices, -1 the root) of the nodes kept, by depth then
   offer order; returns their number, -1 when out of memory. */
int64_t head_tree(const struct head_weights *w, int64_t m, const int64_t *tokens, const float *features,
                  int64_t slot, int64_t start, int64_t budget, int64_t width, const float *taus, int64_t *out_tokens,
                  int64_t *out_parents, struct kernel_pool *pool) {
    const int64_t H = w->H, Vd = w->Vd, QKV = (w->A + 2 * w->K) * w->D;
    const int64_t cap = width * (budget + 1), expanded_cap = budget + 1;
    float *in = malloc((size_t)(m * (4 * H + H + QKV + w->A * w->D)) * sizeof(float));
    float *feats = malloc((size_t)(expanded_cap * H + Vd) * sizeof(float));
    struct candidate *c = malloc((size_t)cap * sizeof(struct candidate));
    int64_t *ints = malloc((size_t)(2 * m + (budget + 3) + 2 * cap) * sizeof(int64_t));
    if (!in || !feats || !c || !ints) { free(in); free(feats); free(c); free(ints); return -1; }
    float *x = in + m * 2 * H, *x2 = x + m * H, *attn_scratch = x2 + m * H;
    float *logits = feats + expanded_cap * H;  /* [Vd] */
    int64_t *where = ints, *tree = where + 2 * m, *order = tree + budget + 3, *kept = order + cap;
    struct tree_state t = {c, 0};
    /* the catch-up: its last entry is the root (feats row 0) */
    for (int64_t i = 0; i < m; i++) {
        head_input(w, w->embed + tokens[i] * H, features + i * H, in + i * 2 * H);
        where[i] = start + i, where[m + i] = slot;
    }
    linear(in, m, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
    attention_block(x, m, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                    w->rope_cos, w->rope_sin, where, where + m, NULL, w->k_cache, w->v_cache, w->S, w->o_wt,
                    attn_scratch, x2, pool, 0);
    head_output(w, x2 + (m - 1) * H, feats, logits, pool);
    const int64_t root_row = start + m - 1;
    offer_children(&t, logits, Vd, taus[0], width, -1, 0.0, 1);
    /* Best first: expand the best candidate not yet expanded, one head row per pass (its children are then
       offered), while it scores at least the budget-th best so far: a descendant never scores above its
       ancestor, so below that none of them could enter the tree. A sure head so grows a chain at a chain's
       cost; the tree is the exact top `budget` of the candidates by path score. */
    for (int64_t expanded = 1; expanded <= budget && root_row + expanded < w->S; expanded++) {
        int64_t best = -1;
        for (int64_t i = 0; i < t.n; i++)
            if (c[i].row == -1 && c[i].depth < budget && (best < 0 || by_score(c, i, best))) best = i;
        if (best < 0) break;
        for (int64_t i = 0; i < t.n; i++) order[i] = i;
        sort_by_score(c, order, t.n);
        if (t.n >= budget && c[best].score < c[order[budget - 1]].score) break;
        struct candidate *node = &c[best];
        node->row = root_row + expanded;
        /* its tree record (one row: offset 1, then depth, root row, its path's rows) */
        int64_t *rec = tree + 1;
        tree[0] = 1, rec[0] = node->depth, rec[1] = root_row;
        for (int64_t a = best, e = node->depth; a >= 0; a = c[a].parent, e--) rec[1 + e] = c[a].row;
        const float *parent_feature = feats + (node->parent < 0 ? 0 : c[node->parent].row - root_row) * H;
        head_input(w, w->embed + w->vocab[node->token] * H, parent_feature, in);
        linear(in, 1, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
        attention_block(x, 1, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                        w->rope_cos, w->rope_sin, &node->row, &slot, tree, w->k_cache, w->v_cache, w->S, w->o_wt,
                        attn_scratch, x2, pool, 0);
        head_output(w, x2, feats + expanded * H, logits, pool);
        offer_children(&t, logits, Vd, taus[node->depth], width, best, node->score, node->depth + 1);
    }
    /* the tree: the `budget` best candidates, then by depth and offer order; parents renumbered */
    for (int64_t i = 0; i < t.n; i++) order[i] = i;
    sort_by_score(c, order, t.n);
    const int64_t n = t.n < budget ? t.n : budget;
    for (int64_t i = 0; i < n; i++) kept[i] = order[i];
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = i; j > 0 && (c[kept[j]].depth < c[kept[j - 1]].depth ||
                                      (c[kept[j]].depth == c[kept[j - 1]].depth && kept[j] < kept[j - 1])); j--) {
            const int64_t s = kept[j];
            kept[j] = kept[j - 1], kept[j - 1] = s;
        }
    for (int64_t i = 0; i < n; i++) {
        out_tokens[i] = c[kept[i]].token;
        out_parents[i] = -1;
        for (int64_t j = 0; j < i; j++)
            if (kept[j] == c[kept[i]].parent) out_parents[i] = j;
    }
    free(in);
    free(feats);
    free(c);
    free(ints);
    return n;
}
