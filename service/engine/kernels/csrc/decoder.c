/* Every decoder layer of a pass in one call, decoder_layers: see decoder.py. */
#include "kernels.h"

#include <stdint.h>
#include <stdlib.h>

/* One layer's constant arguments: its attention sub-block's (attention.c), its post-attention norm's
   and its MoE block's (moe.c), or for a dense layer (dense != 0) its MLP's as swiglu_experts' one
   expert (gate_up_t, down_t, I, moe_fmt). Field order: decoder.DecoderLayer. */
struct decoder_layer {
    const float *attn_norm_w; const void *qkv_wt; const float *qkv_b; const void *o_wt;
    int64_t A, K, D;
    float attn_eps; int attn_fmt;
    const float *mlp_norm_w; float mlp_eps; int moe_fmt;
    const float *router; const void *gate_up_t; const void *down_t; const void *shared_gate_up_t;
    const void *shared_down_t;
    int64_t E, m, gate_up_stride, down_stride, I, Is;
    int norm_topk, dense;
};

/* x [N, H] (the embedded tokens) -> x after all L layers, in place; ids [L, N, m] the routed experts of
   each MoE layer (dense layers write none). last_mlp == 0: a prefill, whose last layer only writes its
   keys and values (x is then left after layer L - 2, ids of layer L - 1 unwritten). k_cache / v_cache:
   layer 0's [slots, K, S, D], the next layer's layer_floats further on. Each layer is attention_block,
   rms_norm, moe_block (a dense layer: swiglu_experts with its MLP as the one expert, weight 1) and the
   residual add, the same calls in the same order as the Python loop, so the result is bitwise its own.
   Returns 0, or 1 when the scratch could not be allocated (nothing written). */
int decoder_layers(float *x, int64_t N, int64_t H, int64_t L, const struct decoder_layer *layers, int last_mlp,
                   const float *rope_cos, const float *rope_sin, const int64_t *positions, const int64_t *slots,
                   const int64_t *tree, float *k_cache, float *v_cache, int64_t layer_floats, int64_t S,
                   int64_t *ids, struct kernel_pool *attention_pool, struct kernel_pool *moe_pool) {
    int64_t attention_floats = 0, logit_floats = 0, weight_floats = 0;
    for (int64_t l = 0; l < L; l++) {
        const struct decoder_layer *d = &layers[l];
        const int64_t per_token = H + (d->A + 2 * d->K) * d->D + d->A * d->D;
        if (N * per_token > attention_floats) attention_floats = N * per_token;
        if (N * (d->E + 1) > logit_floats) logit_floats = N * (d->E + 1);
        if (N * d->m > weight_floats) weight_floats = N * d->m;
    }
    if (weight_floats < N) weight_floats = N;  /* a dense layer's weights: one per position */
    const size_t floats = (size_t)(attention_floats + 3 * N * H + logit_floats + weight_floats + N);
    float *scratch = malloc(floats * sizeof(float) + (size_t)N * sizeof(int64_t));
    if (!scratch) return 1;
    float *attended = scratch + attention_floats, *normed = attended + N * H, *moe_out = normed + N * H;
    float *logits = moe_out + N * H, *weights = logits + logit_floats, *scale = weights + weight_floats;
    int64_t *only_expert = (int64_t *)(scratch + floats);  /* a dense layer's ids: expert 0 for every position */
    int64_t *layer_ids = ids;
    for (int64_t l = 0; l < L; l++) {
        const struct decoder_layer *d = &layers[l];
        float *kc = k_cache + l * layer_floats, *vc = v_cache + l * layer_floats;
        const int kv_only = !last_mlp && l == L - 1;
        attention_block(x, N, H, d->attn_norm_w, d->attn_eps, d->qkv_wt, d->qkv_b, d->A, d->K, d->D, d->attn_fmt,
                        rope_cos, rope_sin, positions, slots, tree, kc, vc, S, d->o_wt, scratch, attended,
                        attention_pool, kv_only);
        if (kv_only) break;
        rms_norm(attended, N, H, d->mlp_norm_w, d->mlp_eps, normed);
        if (d->dense) {
            for (int64_t p = 0; p < N; p++) only_expert[p] = 0, weights[p] = 1.0f;
            swiglu_experts(normed, N, H, d->I, d->gate_up_t, d->gate_up_stride, d->down_t, d->down_stride, d->moe_fmt,
                           1, only_expert, weights, 1, moe_out, 0);
        } else {
            moe_block(normed, N, H, d->router, d->E, d->m, d->norm_topk, d->gate_up_t, d->gate_up_stride, d->down_t,
                      d->down_stride, d->I, d->shared_gate_up_t, d->shared_down_t, d->Is, d->moe_fmt, logits,
                      layer_ids, weights, moe_out, scale, moe_pool);
            layer_ids += N * d->m;
        }
        for (int64_t i = 0; i < N * H; i++) x[i] = attended[i] + moe_out[i];
    }
    free(scratch);
    return 0;
}
