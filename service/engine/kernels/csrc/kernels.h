/* What the sources of the kernels' library share: the panels' layout, the tile macros, the helpers
   later files call (KERNEL_PRIVATE: static in the library's one translation unit, see linkage.h) and
   the entry points ctypes binds (library.py). Every source includes it, so each states what it uses
   and compiles alone; unity_kernels.c compiles them as one. */
#ifndef MOESPEC_KERNELS_H
#define MOESPEC_KERNELS_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernel_pool.h"
#include "linkage.h"

/* Weights for the products (matmul.c) are packed in panels (`pack_panels`): a [Kd, C] matrix (a weight
   stored transposed) as ceil(C / 64) panels of [Kd, 64], columns past C zero. A tile then streams one
   contiguous panel (a row-major [Kd, C] read 64 columns at a time jumps C floats per k: for the output
   layer 16 KB, a new page every step, which the hardware prefetchers do not follow).

   out[t, c] = sum over k ascending of x[t, k] * w[k, c] (one fused multiply-add per term, from 0),
   then + bias[c]: x [N, Kd], out [N, C]. Every element takes the same arithmetic whatever N is and
   wherever it falls in a tile, so a row's result never depends on the other rows; tiles of 4 rows x 64
   columns (3, 2 or 1 for the rows left over) reuse each loaded weight vector for every row. */
#define PANEL 64
/* Panel formats (`PackedWeight.format`): float32; bf16 values widened exactly (float32 arithmetic); bf16
   pairs with bf16 arithmetic (bf16.c). */
#define PANELS_F32 0
#define PANELS_BF16 1
#define PANELS_BF16_MATH 2
#define PANELS_BF16_AMX 3  /* format 2's layout, AMX arithmetic (amx.c) */
/* The build has the tile code: a compiler targeting AMX tiles and bf16 tiles, on Linux (which grants
   the tiles per process, amx_enable). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KERNELS_HAVE_AMX 1
#else
#define KERNELS_HAVE_AMX 0
#endif

/* common.c */
KERNEL_PRIVATE float dot(const float *a, const float *b, int64_t n);
KERNEL_PRIVATE float bf16_value(uint16_t h);
#if defined(__AVX512F__)
KERNEL_PRIVATE __m512 exp512(__m512 x);

/* A tile's accumulators acc[ROWS][4] + bias to out (only the `valid` first columns of the panel). */
#define STORE_TILE(ROWS)                                                                               \
    for (int v = 0; v < 4; v++) {                                                                      \
        const int64_t left = valid - 16 * v;                                                           \
        if (left <= 0) break;                                                                          \
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);         \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c0 + 16 * v) : _mm512_setzero_ps(); \
        for (int i = 0; i < ROWS; i++)                                                                 \
            _mm512_mask_storeu_ps(out + i * C + c0 + 16 * v, keep, _mm512_add_ps(acc[i][v], b));       \
    }
/* Rows 0..N of x (a row every XROW elements) through one panel (W, K: the tile's weights and depth):
   tiles PREFIX_4x64 of 4 rows, then one of 3, 2 or 1 for the rows left over; needs C, c0, valid and
   bias in scope. 2- and 3-row tiles: in a batched step most experts serve 1-3 positions, which would
   otherwise reload each weight vector once per row. */
#define TILE_ROWS(PREFIX, X, XROW, K, W, N, OUT)                                                       \
    do {                                                                                               \
        int64_t t_ = 0;                                                                                \
        for (; t_ + 4 <= (N); t_ += 4) PREFIX##_4x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 3) PREFIX##_3x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 2) PREFIX##_2x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
        if ((N) - t_ == 1) PREFIX##_1x64((X) + t_ * (XROW), K, W, C, c0, valid, bias, (OUT) + t_ * C); \
    } while (0)
/* The tiles of float32 and of bf16 panels widened to float32 (MATMUL_TILE in common.c), for TILE_ROWS. */
KERNEL_PRIVATE void f32_tile_4x64(const float *x, int64_t Kd, const float *panel, int64_t C, int64_t c0, int64_t valid,
                                  const float *bias, float *out);
KERNEL_PRIVATE void f32_tile_3x64(const float *x, int64_t Kd, const float *panel, int64_t C, int64_t c0, int64_t valid,
                                  const float *bias, float *out);
KERNEL_PRIVATE void f32_tile_2x64(const float *x, int64_t Kd, const float *panel, int64_t C, int64_t c0, int64_t valid,
                                  const float *bias, float *out);
KERNEL_PRIVATE void f32_tile_1x64(const float *x, int64_t Kd, const float *panel, int64_t C, int64_t c0, int64_t valid,
                                  const float *bias, float *out);
KERNEL_PRIVATE void bf16_tile_4x64(const float *x, int64_t Kd, const uint16_t *panel, int64_t C, int64_t c0,
                                   int64_t valid, const float *bias, float *out);
KERNEL_PRIVATE void bf16_tile_3x64(const float *x, int64_t Kd, const uint16_t *panel, int64_t C, int64_t c0,
                                   int64_t valid, const float *bias, float *out);
KERNEL_PRIVATE void bf16_tile_2x64(const float *x, int64_t Kd, const uint16_t *panel, int64_t C, int64_t c0,
                                   int64_t valid, const float *bias, float *out);
KERNEL_PRIVATE void bf16_tile_1x64(const float *x, int64_t Kd, const uint16_t *panel, int64_t C, int64_t c0,
                                   int64_t valid, const float *bias, float *out);
#endif

/* bf16.c */
KERNEL_PRIVATE void bf16_rows(const float *x, int64_t rows, int64_t Kd, int64_t Kd2, uint16_t *xb);
KERNEL_PRIVATE void matmul_panels_bf16_math(const float *x, int64_t N, int64_t Kd, const uint16_t *packed, int64_t C,
                                            int64_t p_begin, int64_t p_end, const float *bias, float *out);
int bf16_dot_native(void);

/* amx.c */
#if KERNELS_HAVE_AMX
KERNEL_PRIVATE void matmul_panels_amx(const float *x, int64_t N, int64_t Kd, const uint16_t *packed, int64_t C,
                                      int64_t p_begin, int64_t p_end, const float *bias, float *out);
#endif
int amx_enable(void);

/* matmul.c */
KERNEL_PRIVATE void matmul_panels(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
                                  int64_t p_begin, int64_t p_end, const float *bias, float *out);
KERNEL_PRIVATE void matmul_p(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
                             const float *bias, float *out);
void rms_norm(const float *x, int64_t rows, int64_t H, const float *weight, float eps, float *out);
void linear(const float *x, int64_t w, int64_t H, const void *Wt, int fmt, int64_t V, float *out,
            struct kernel_pool *pool);

/* moe.c */
KERNEL_PRIVATE void swiglu_act(const float *g, const float *u, float r, int64_t I, float *act);
void swiglu_experts(const float *x, int64_t w, int64_t H, int64_t I, const void *gate_up_t,
                    int64_t gate_up_stride, const void *down_t, int64_t down_stride, int fmt, int64_t num_experts,
                    const int64_t *ids, const float *weights, int64_t n, float *out, int accumulate);
void moe_block(const float *x, int64_t w, int64_t H, const float *router, int64_t E, int64_t m, int norm_topk,
               const void *gate_up_t, int64_t gate_up_stride, const void *down_t, int64_t down_stride, int64_t I,
               const void *shared_gate_up_t, const void *shared_down_t, int64_t Is, int fmt,
               float *logits, int64_t *ids, float *weights, float *out, float *scale, struct kernel_pool *pool);

/* attention.c */
void attention_block(const float *x, int64_t N, int64_t H, const float *norm_w, float eps,
                     const void *qkv_wt, const float *qkv_b, int64_t A, int64_t K, int64_t D, int fmt,
                     const float *rope_cos, const float *rope_sin, const int64_t *positions, const int64_t *slots,
                     const int64_t *tree, float *k_cache, float *v_cache, int64_t S, const void *o_wt,
                     float *scratch, float *out, struct kernel_pool *pool, int kv_only);

/* head.c */
struct head_weights;
int head_draft(const struct head_weights *w, int64_t m, const int64_t *tokens, const float *features,
               int64_t slot, int64_t start, int64_t k, float temperature, const float *uniforms, int64_t *picks,
               float *q, struct kernel_pool *pool);
int64_t head_tree(const struct head_weights *w, int64_t m, const int64_t *tokens, const float *features,
                  int64_t slot, int64_t start, int64_t budget, int64_t width, const float *taus, int64_t *out_tokens,
                  int64_t *out_parents, struct kernel_pool *pool);

/* decoder.c */
struct decoder_layer;
int decoder_layers(float *x, int64_t N, int64_t H, int64_t L, const struct decoder_layer *layers, int last_mlp,
                   const float *rope_cos, const float *rope_sin, const int64_t *positions, const int64_t *slots,
                   const int64_t *tree, float *k_cache, float *v_cache, int64_t layer_floats, int64_t S,
                   int64_t *ids, struct kernel_pool *attention_pool, struct kernel_pool *moe_pool);

/* forward.c */
struct output_head;
int forward_logits(const int64_t *tokens, int64_t N, int64_t H, int64_t L, const struct decoder_layer *layers,
                   const struct output_head *head, const float *rope_cos, const float *rope_sin,
                   const int64_t *positions, const int64_t *slots, const int64_t *tree, float *k_cache,
                   float *v_cache, int64_t layer_floats,
                   int64_t S, int64_t *ids, struct kernel_pool *attention_pool, struct kernel_pool *moe_pool,
                   struct kernel_pool *lm_pool, const int64_t *rows, int64_t R, float *features, float *logits,
                   int64_t *argmax);
struct step_sampling;
int64_t decode_steps(const int64_t *tokens, int64_t B, int64_t H, int64_t L, const struct decoder_layer *layers,
                     const struct output_head *head, const float *rope_cos, const float *rope_sin,
                     const int64_t *positions, const int64_t *slots, float *k_cache, float *v_cache,
                     int64_t layer_floats, int64_t S, int64_t K, int64_t eos, const struct step_sampling *sampling,
                     int64_t ids_per_step, int64_t *ids, int64_t *picks, int64_t *step_ns,
                     struct kernel_pool *attention_pool, struct kernel_pool *moe_pool, struct kernel_pool *lm_pool);

/* sampling.c */
KERNEL_PRIVATE int64_t sample_row(const float *logits, int64_t V, float temperature, int64_t top_k, float top_p,
                                  float u, float *scratch);
int sample_rows(const float *logits, int64_t n, int64_t V, float temperature, int64_t top_k, float top_p,
                const float *uniforms, int64_t *tokens);
int64_t accept_drafts(const float *logits, int64_t k, int64_t V, float temperature, int64_t top_k, float top_p,
                      const int64_t *drafts, const float *q, const float *uniforms, uint8_t *accepted,
                      int64_t *token);

#endif
