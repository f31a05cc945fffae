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

/* The `width` likeliest draft indices of logits [Vd] at temperature tau, offered as children of `parent`
   with their path scores (log-softmax, in double), best first (ties to the lower index). */
static void offer_children(struct tree_state *t, const float *logits, int64_t Vd, double tau, int64_t width,
                           int64_t parent, double base, int64_t depth) {
    double top = -INFINITY, total = 0.0;
    for (int64_t i = 0; i < Vd; i++)
        if (logits[i] / tau > top) top = logits[i] / tau;
    for (int64_t i = 0; i < Vd; i++) total += exp(logits[i] / tau - top);
    const double log_total = top + log(total);
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
        t->c[t->n++] = (struct candidate){best[j], parent, depth, -1, base + logits[best[j]] / tau - log_total};
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
   nodes (see head.py): taus [budget] the ranking temperature of each depth. Out: tokens [budget] draft
   indices and parents [budget] (node indices, -1 the root) of the nodes kept, by depth then offer order;
   returns their number, -1 when out of memory. */
int64_t head_tree(const struct head_weights *w, int64_t m, const int64_t *tokens, const float *features,
                  int64_t slot, int64_t start, int64_t budget, int64_t width, const float *taus, int64_t *out_tokens,
                  int64_t *out_parents, struct kernel_pool *pool) {
    const int64_t H = w->H, Vd = w->Vd, QKV = (w->A + 2 * w->K) * w->D, n_in = m > width ? m : width;
    const int64_t cap = width + budget * width * width, expanded_cap = budget * width + 1;
    const int64_t record = budget + 2;  /* one tree record: depth, root row, up to `budget` rows */
    float *in = malloc((size_t)(n_in * (4 * H + H + QKV + w->A * w->D)) * sizeof(float));
    float *feats = malloc((size_t)(expanded_cap * H + width * Vd) * sizeof(float));
    struct candidate *c = malloc((size_t)cap * sizeof(struct candidate));
    int64_t *ints = malloc((size_t)(2 * n_in + width * (1 + record) + 3 * cap) * sizeof(int64_t));
    if (!in || !feats || !c || !ints) { free(in); free(feats); free(c); free(ints); return -1; }
    float *x = in + n_in * 2 * H, *x2 = x + n_in * H, *attn_scratch = x2 + n_in * H;
    float *logits = feats + expanded_cap * H;  /* [width, Vd] */
    int64_t *where = ints, *tree = where + 2 * n_in, *frontier = tree + width * (1 + record), *order = frontier + cap;
    int64_t *kept = order + cap;
    struct tree_state t = {c, 0};
    /* the catch-up: its last entry is the root (feats row 0) */
    for (int64_t i = 0; i < m; i++) {
        head_input(w, w->embed + tokens[i] * H, features + i * H, in + i * 2 * H);
        where[i] = start + i, where[n_in + i] = slot;
    }
    linear(in, m, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
    attention_block(x, m, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                    w->rope_cos, w->rope_sin, where, where + n_in, NULL, w->k_cache, w->v_cache, w->S, w->o_wt,
                    attn_scratch, x2, pool, 0);
    head_output(w, x2 + (m - 1) * H, feats, logits, pool);
    const int64_t root_row = start + m - 1;
    int64_t expanded = 1, n_frontier = 0;
    offer_children(&t, logits, Vd, taus[0], width, -1, 0.0, 1);
    for (int64_t i = 0; i < t.n; i++) frontier[n_frontier++] = i;
    for (int64_t depth = 1; depth < budget && n_frontier > 0; depth++) {
        /* the frontier's entries: rows past the root, one per node expanded so far, while the cache has room */
        int64_t rows = 0;
        for (int64_t f = 0; f < n_frontier && root_row + expanded + rows < w->S; f++) {
            struct candidate *node = &c[frontier[f]];
            node->row = root_row + expanded + rows;
            int64_t *rec = tree + width + rows * record, d = node->depth;
            rec[0] = d, rec[1] = root_row;
            for (int64_t a = frontier[f], e = d; a >= 0; a = c[a].parent, e--) rec[1 + e] = c[a].row;
            tree[rows] = width + rows * record;
            const int64_t parent = node->parent;
            const float *parent_feature = feats + (parent < 0 ? 0 : (c[parent].row - root_row)) * H;
            head_input(w, w->embed + w->vocab[node->token] * H, parent_feature, in + rows * 2 * H);
            where[rows] = node->row, where[n_in + rows] = slot;
            rows++;
        }
        if (rows == 0) break;
        if (rows < width) {  /* the kernel reads `rows` offsets, then the records: move them up */
            for (int64_t r = 0; r < rows; r++) {
                memmove(tree + rows + r * record, tree + width + r * record, (size_t)record * sizeof(int64_t));
                tree[r] = rows + r * record;
            }
        }
        memmove(where + rows, where + n_in, (size_t)rows * sizeof(int64_t));
        linear(in, rows, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
        attention_block(x, rows, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                        w->rope_cos, w->rope_sin, where, where + rows, tree, w->k_cache, w->v_cache, w->S,
                        w->o_wt, attn_scratch, x2, pool, 0);
        const int64_t first_new = t.n;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t f = frontier[r];
            head_output(w, x2 + r * H, feats + (expanded + r) * H, logits, pool);
            offer_children(&t, logits, Vd, taus[depth < budget ? depth : budget - 1], width, f, c[f].score,
                           depth + 1);
        }
        expanded += rows;
        /* the next frontier: the best `width` new children that score at least the budget-th best so far (a
           descendant never scores above its ancestor: below that, none of its descendants could enter the
           tree, so it is not worth a head row) */
        const int64_t n_new = t.n - first_new;
        for (int64_t i = 0; i < t.n; i++) order[i] = i;
        sort_by_score(c, order, t.n);
        const double kth = t.n >= budget ? c[order[budget - 1]].score : -INFINITY;
        for (int64_t i = 0; i < n_new; i++) frontier[i] = first_new + i;
        sort_by_score(c, frontier, n_new);
        n_frontier = 0;
        while (n_frontier < n_new && n_frontier < width && c[frontier[n_frontier]].score >= kth) n_frontier++;
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
