/* A draft head's catch-up and drafting chain for one sequence: see head.py. */
#include "head.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>



/* Draft index from logits [Vd]: first maximum at temperature 0, else an inverse-CDF draw with u from
   softmax(logits / T), written to q. */
static int64_t head_pick(const float *logits, int64_t Vd, float temperature, float u, float *q) {
    int64_t best = 0;
    for (int64_t i = 1; i < Vd; i++)
        if (logits[i] > logits[best]) best = i;
    if (temperature == 0.0f) return best;
    const float top = logits[best], inv_t = 1.0f / temperature;
    float total = 0.0f;
    for (int64_t i = 0; i < Vd; i++) {
        q[i] = expf((logits[i] - top) * inv_t);
        total += q[i];
    }
    const float scale = 1.0f / total;
    for (int64_t i = 0; i < Vd; i++) q[i] *= scale;
    float below = 0.0f;
    int64_t last = best;  /* the last index with mass: what rounding past the total falls back to */
    for (int64_t i = 0; i < Vd; i++) {
        if (q[i] <= 0.0f) continue;
        last = i;
        below += q[i];
        if (u < below) return i;
    }
    return last;
}

/* The head over one entry's input (embedding row e, feature row f) up to its attention: writes the fc
   input [2H] to in. */
KERNEL_PRIVATE void head_input(const struct head_weights *w, const float *e, const float *f, float *in) {
    rms_norm(e, 1, w->H, w->embed_norm_w, w->eps, in);
    rms_norm(f, 1, w->H, w->feature_norm_w, w->eps, in + w->H);
}

/* After attention, one row: feature = x2 + MLP(norm(x2)), logits = lm_head(norm(feature)). The products
   split their output panels over the pool (`linear`), each panel as matmul_p computes it; the MLP is
   swiglu_experts' one expert of weight 1 step by step (its products, swiglu_act with r = 1, the sum
   into a zeroed row), so the row is bitwise the one-thread chain's and `DraftHead.forward_ragged`'s. */
KERNEL_PRIVATE void head_output(const struct head_weights *w, const float *x2, float *feature, float *logits,
                                struct kernel_pool *pool) {
    const int64_t H = w->H, I = w->I;
    float hn[H], gu[2 * I], act[I], mlp[H];
    rms_norm(x2, 1, H, w->post_norm_w, w->eps, hn);
    linear(hn, 1, H, w->gate_up_t, w->mlp_fmt, 2 * I, gu, pool);
    swiglu_act(gu, gu + I, 1.0f, I, act);
    linear(act, 1, I, w->down_t, w->mlp_fmt, H, mlp, pool);
    for (int64_t h = 0; h < H; h++) feature[h] = x2[h] + (0.0f + mlp[h]);
    rms_norm(feature, 1, H, w->final_norm_w, w->eps, hn);
    linear(hn, 1, H, w->lm_wt, w->lm_fmt, w->Vd, logits, pool);
}

/* m entries (target ids tokens [m], features [m, H]) at positions start.. of `slot`: the catch-up, its
   keys and values written, then k drafts (see head.py); every product and attention split over the
   pool's threads (NULL: this thread alone; bitwise the same). Returns 0, or -1 when out of memory. */
int head_draft(const struct head_weights *w, int64_t m, const int64_t *tokens, const float *features,
               int64_t slot, int64_t start, int64_t k, float temperature, const float *uniforms, int64_t *picks,
               float *q, struct kernel_pool *pool) {
    const int64_t H = w->H, Vd = w->Vd, R = (w->A + 2 * w->K) * w->D, n = m > 1 ? m : 1;
    float *in = malloc((size_t)(n * (4 * H + H + R + w->A * w->D) + 2 * H + Vd) * sizeof(float));
    int64_t *where = malloc((size_t)(2 * n) * sizeof(int64_t));  /* positions [m], slots [m] */
    if (!in || !where) { free(in); free(where); return -1; }
    float *x = in + n * 2 * H, *x2 = x + n * H, *attn_scratch = x2 + n * H;
    float *feature = attn_scratch + n * (H + R + w->A * w->D), *logits = feature + H;
    for (int64_t i = 0; i < m; i++) {
        head_input(w, w->embed + tokens[i] * H, features + i * H, in + i * 2 * H);
        where[i] = start + i;
        where[m + i] = slot;
    }
    linear(in, m, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
    attention_block(x, m, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                    w->rope_cos, w->rope_sin, where, where + m, NULL, w->k_cache, w->v_cache, w->S, w->o_wt,
                    attn_scratch, x2, pool, 0);
    head_output(w, x2 + (m - 1) * H, feature, logits, pool);
    for (int64_t j = 0; j < k; j++) {
        picks[j] = head_pick(logits, Vd, temperature, uniforms ? uniforms[j] : 0.0f, q ? q + j * Vd : NULL);
        if (j == k - 1) break;
        const int64_t pos = start + m + j;
        head_input(w, w->embed + w->vocab[picks[j]] * H, feature, in);
        linear(in, 1, 2 * H, w->fc_wt, w->fc_fmt, H, x, pool);
        attention_block(x, 1, H, w->attn_norm_w, w->eps, w->qkv_wt, w->qkv_b, w->A, w->K, w->D, w->attn_fmt,
                        w->rope_cos, w->rope_sin, &pos, &slot, NULL, w->k_cache, w->v_cache, w->S, w->o_wt,
                        attn_scratch, x2, pool, 0);
        head_output(w, x2, feature, logits, pool);
    }
    free(in);
    free(where);
    return 0;
}
