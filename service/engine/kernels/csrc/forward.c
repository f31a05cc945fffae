/* A short pass from token ids to logits in one call, forward_logits (see forward.py), and greedy decode
   steps back to back, decode_greedy_steps (see library.py's Kernels.decode_greedy_steps). */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The model's ends around the decoder layers (field order: forward.OutputHead). */
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

/* Up to K greedy decode steps of B sequences in one call, each step's argmax the next step's tokens:
   step s is forward_logits over tokens_s [B] (tokens, then the argmax of step s - 1) at positions + s
   in slots, every row's logits, so every step is bitwise the pass a separate call would run. ids
   [K, L, B, m] and argmax [K, B] take each step's routed experts and picks; step_ns [K] the wall
   nanoseconds each step took (CLOCK_MONOTONIC). The steps stop after the first whose picks hold `eos`
   (eos < 0: none is looked for). Returns the steps run (1..K); -1 when scratch could not be allocated,
   -2 for a token id outside [0, V) (both before anything is written). positions + K - 1 must lie in
   the cache (the caller checks). */
int64_t decode_greedy_steps(const int64_t *tokens, int64_t B, int64_t H, int64_t L,
                            const struct decoder_layer *layers, const struct output_head *head,
                            const float *rope_cos, const float *rope_sin, const int64_t *positions,
                            const int64_t *slots, float *k_cache, float *v_cache, int64_t layer_floats, int64_t S,
                            int64_t K, int64_t eos, int64_t ids_per_step, int64_t *ids, int64_t *argmax,
                            int64_t *step_ns, struct kernel_pool *attention_pool, struct kernel_pool *moe_pool,
                            struct kernel_pool *lm_pool) {
    for (int64_t b = 0; b < B; b++)
        if (tokens[b] < 0 || tokens[b] >= head->V) return -2;
    float *scratch = malloc((size_t)(B * (H + head->V)) * sizeof(float));
    int64_t *at = malloc((size_t)B * sizeof(int64_t));
    if (!scratch || !at) {
        free(scratch);
        free(at);
        return -1;
    }
    memcpy(at, positions, (size_t)B * sizeof(int64_t));
    int64_t last = monotonic_ns(), steps = 0;
    while (steps < K) {
        const int64_t *step_tokens = steps == 0 ? tokens : argmax + (steps - 1) * B;
        if (forward_logits(step_tokens, B, H, L, layers, head, rope_cos, rope_sin, at, slots, NULL, k_cache, v_cache,
                           layer_floats, S, ids + steps * ids_per_step, attention_pool, moe_pool, lm_pool, NULL, B,
                           scratch, scratch + B * H, argmax + steps * B) != 0) {
            if (steps == 0) steps = -1;  /* (picks are ids of [0, V): a later step's tokens are always valid) */
            break;
        }
        const int64_t now = monotonic_ns();
        step_ns[steps] = now - last;
        last = now;
        int stop = 0;
        for (int64_t b = 0; b < B; b++) {
            stop |= argmax[steps * B + b] == eos;
            at[b]++;
        }
        steps++;
        if (stop) break;
    }
    free(scratch);
    free(at);
    return steps;
}
