/* A short pass from token ids to logits in one call, forward_logits (see forward.py), and plain decode
   steps back to back, greedy or sampled, decode_steps (see library.py's Kernels.decode_steps). */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The model's ends around the decoder layers (field order: forward.OutputHead). */
/* Per-row sampling of decode_steps (field order: forward.StepSampling). */
struct step_sampling {
    const float *temperature;  /* [B] 0: the row picks its argmax */
    const int64_t *top_k;      /* [B] 0: off */
    const float *top_p;        /* [B] 1: off */
    const float *uniforms;     /* [K, B] each step's draw for each sampled row */
};

struct output_head {
    const float *embed;   /* [V, H] the embedding table */
    const float *norm_w;  /* [H] the final norm's weight */
    const void *lm_wt;    /* the output layer, packed [V, H] (matmul_p) */
    int64_t V;
    float eps;
    int lm_fmt;
};

/* The first maximum of a row, a NaN before any number (numpy's argmax, which the Python path reads). */
static int64_t first_max(const float *row, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (isnan(row[i])) return i;
        if (row[i] > row[best]) best = i;
    }
    return best;
}

/* tokens [N] -> their embedding rows [N, H], then every decoder layer (decoder_layers, ids [L, N, m]),
   then for R rows of the pass (rows [R] their indices, NULL: all N in order): features [R, H] the final
   norm of their hidden states, logits [R, V] the output layer over them (its panels split over
   lm_pool), argmax [R] each logit row's first maximum. The same calls on the same values as the
   separate ones (embedding, decoder_layers, index_select, rms_norm, linear), so bitwise their result.
   Returns 0; 1 when the hidden states or decoder_layers' scratch could not be allocated; 2 for a token
   id outside [0, V), 3 for a row outside [0, N) (all three before anything is written). */
int forward_logits(const int64_t *tokens, int64_t N, int64_t H, int64_t L, const struct decoder_layer *layers,
                   const struct output_head *head, const float *rope_cos, const float *rope_sin,
                   const int64_t *positions, const int64_t *slots, const int64_t *tree, float *k_cache,
                   float *v_cache, int64_t layer_floats,
                   int64_t S, int64_t *ids, struct kernel_pool *attention_pool, struct kernel_pool *moe_pool,
                   struct kernel_pool *lm_pool, const int64_t *rows, int64_t R, float *features, float *logits,
                   int64_t *argmax) {
    for (int64_t t = 0; t < N; t++)
        if (tokens[t] < 0 || tokens[t] >= head->V) return 2;
    for (int64_t r = 0; rows && r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) return 3;
    float *x = malloc((size_t)(N * H) * sizeof(float));
    if (!x) return 1;
    for (int64_t t = 0; t < N; t++) memcpy(x + t * H, head->embed + tokens[t] * H, (size_t)H * sizeof(float));
    if (decoder_layers(x, N, H, L, layers, 1, rope_cos, rope_sin, positions, slots, tree, k_cache, v_cache,
                       layer_floats, S, ids, attention_pool, moe_pool) != 0) {
        free(x);
        return 1;
    }
    for (int64_t r = 0; r < R; r++)
        rms_norm(x + (rows ? rows[r] : r) * H, 1, H, head->norm_w, head->eps, features + r * H);
    free(x);
    linear(features, R, H, head->lm_wt, head->lm_fmt, head->V, logits, lm_pool);
    for (int64_t r = 0; r < R; r++) argmax[r] = first_max(logits + r * head->V, head->V);
    return 0;
}

/* Up to K plain decode steps of B sequences in one call, each step's picks the next step's tokens: step s
   is forward_logits over tokens_s [B] (tokens, then the picks of step s - 1) at positions + s in slots,
   every row's logits, so every step is bitwise the pass a separate call would run. A row picks its
   logits' argmax, or, where `sampling` is given and its temperature [B] is above 0, the token
   sample_row draws with its top_k [B], top_p [B] and uniforms [K, B] (the step's own). ids [K, L, B, m]
   and picks [K, B] take each step's routed experts and picks; step_ns [K] the wall nanoseconds each
   step took (CLOCK_MONOTONIC). The steps stop after the first whose picks hold `eos` (eos < 0: none is
   looked for). Returns the steps run (1..K); -1 when scratch could not be allocated, -2 for a token id
   outside [0, V) (both before anything is written). positions + K - 1 must lie in the cache (the
   caller checks). */
int64_t decode_steps(const int64_t *tokens, int64_t B, int64_t H, int64_t L, const struct decoder_layer *layers,
                     const struct output_head *head, const float *rope_cos, const float *rope_sin,
                     const int64_t *positions, const int64_t *slots, float *k_cache, float *v_cache,
                     int64_t layer_floats, int64_t S, int64_t K, int64_t eos, const struct step_sampling *sampling,
                     int64_t ids_per_step, int64_t *ids, int64_t *picks, int64_t *step_ns,
                     struct kernel_pool *attention_pool, struct kernel_pool *moe_pool, struct kernel_pool *lm_pool) {
    for (int64_t b = 0; b < B; b++)
        if (tokens[b] < 0 || tokens[b] >= head->V) return -2;
    const int64_t V = head->V;
    float *scratch = malloc((size_t)(B * (H + V) + 2 * V) * sizeof(float));  /* features, logits, a draw's */
    int64_t *at = malloc((size_t)B * sizeof(int64_t));
    if (!scratch || !at) {
        free(scratch);
        free(at);
        return -1;
    }
    float *logits = scratch + B * H, *draw = logits + B * V;
    memcpy(at, positions, (size_t)B * sizeof(int64_t));
    int64_t last = monotonic_ns(), steps = 0;
    while (steps < K) {
        const int64_t *step_tokens = steps == 0 ? tokens : picks + (steps - 1) * B;
        int64_t *step_picks = picks + steps * B;
        if (forward_logits(step_tokens, B, H, L, layers, head, rope_cos, rope_sin, at, slots, NULL, k_cache, v_cache,
                           layer_floats, S, ids + steps * ids_per_step, attention_pool, moe_pool, lm_pool, NULL, B,
                           scratch, logits, step_picks) != 0) {
            if (steps == 0) steps = -1;  /* (picks are ids of [0, V): a later step's tokens are always valid) */
            break;
        }
        for (int64_t b = 0; sampling && b < B; b++)
            if (sampling->temperature[b] > 0.0f)
                step_picks[b] = sample_row(logits + b * V, V, sampling->temperature[b], sampling->top_k[b],
                                           sampling->top_p[b], sampling->uniforms[steps * B + b], draw);
        const int64_t now = monotonic_ns();
        step_ns[steps] = now - last;
        last = now;
        int stop = 0;
        for (int64_t b = 0; b < B; b++) {
            stop |= step_picks[b] == eos;
            at[b]++;
        }
        steps++;
        if (stop) break;
    }
    free(scratch);
    free(at);
    return steps;
}
