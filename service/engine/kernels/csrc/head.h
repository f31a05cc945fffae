/* The draft head's weights as its kernels read them (head.c, head_tree.c), and the steps they share. */
#ifndef MOESPEC_HEAD_H
#define MOESPEC_HEAD_H

#include "kernels.h"

struct head_weights {
    int64_t H, I, Vd, A, K, D, S, V, slots;  /* S: cache positions per slot; V: the target's vocabulary */
    float eps;
    const float *embed;  /* [V, H]: the target's embedding table */
    const float *embed_norm_w, *feature_norm_w, *attn_norm_w, *post_norm_w, *final_norm_w;  /* [H] each */
    const void *fc_wt; int fc_fmt;  /* packed [H, 2H] */
    const void *qkv_wt; const float *qkv_b; const void *o_wt; int attn_fmt;
    const void *gate_up_t, *down_t; int mlp_fmt;
    const void *lm_wt; int lm_fmt;  /* packed [Vd, H] */
    const int64_t *vocab;  /* [Vd] target token id of each draft index */
    const float *rope_cos, *rope_sin;
    float *k_cache, *v_cache;  /* the head's one layer: [slots, K, S, D] */
};

/* The head over one entry's input (embedding row e, feature row f) up to its attention: the fc input [2H]. */
KERNEL_PRIVATE void head_input(const struct head_weights *w, const float *e, const float *f, float *in);
/* After attention, one row: its feature and its logits (head.c). */
KERNEL_PRIVATE void head_output(const struct head_weights *w, const float *x2, float *feature, float *logits,
                                struct kernel_pool *pool);

/* spec_steps.c: the target's side of head_greedy_steps (field order: forward.SpecTarget). */
struct spec_target {
    const struct decoder_layer *layers;
    const struct output_head *head;
    int64_t H, V, L, m, S, layer_floats;
    const float *rope_cos, *rope_sin;
    float *k_cache, *v_cache;
    float *features;  /* [slots, S, H]: the target's final features of every position, what the head reads */
};
int64_t head_greedy_steps(const struct head_weights *hw, const struct spec_target *t, int64_t slot,
                          int64_t *ids, int64_t n, int64_t draft_valid, int64_t k, int64_t budget, int64_t eos,
                          int64_t steps, int64_t *drafts, int64_t *window, int64_t *accepted, int64_t *matches,
                          int64_t *bonus, int64_t *routed, int64_t *step_ns, struct kernel_pool *head_pool,
                          struct kernel_pool *target_pool);

#endif
