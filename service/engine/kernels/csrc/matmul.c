/* The products over packed panels (any format), rms_norm, and the output layer (`linear`). */
#include "kernels.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Panels [p_begin, p_end) of the product: out's columns 64 p_begin .. min(64 p_end, C). */
KERNEL_PRIVATE void matmul_panels(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
                                  int64_t p_begin, int64_t p_end, const float *bias, float *out) {
    if (fmt == PANELS_BF16_MATH) {
        matmul_panels_bf16_math(x, N, Kd, packed, C, p_begin, p_end, bias, out);
        return;
    }
#if KERNELS_HAVE_AMX
    if (fmt == PANELS_BF16_AMX) {
        matmul_panels_amx(x, N, Kd, packed, C, p_begin, p_end, bias, out);
        return;
    }
#endif
    const int bf16 = fmt == PANELS_BF16;
    for (int64_t p = p_begin; p < p_end; p++) {
        const int64_t at = p * Kd * PANEL, c0 = p * PANEL, valid = C - c0 < PANEL ? C - c0 : PANEL;
        const float *f32 = (const float *)packed + at;
        const uint16_t *b16 = (const uint16_t *)packed + at;
#if defined(__AVX512F__)
        if (bf16)
            TILE_ROWS(bf16_tile, x, Kd, Kd, b16, N, out);
        else
            TILE_ROWS(f32_tile, x, Kd, Kd, f32, N, out);
#else
        for (int64_t t = 0; t < N; t++) {
            float *o = out + t * C + c0;
            for (int64_t c = 0; c < valid; c++) o[c] = 0.0f;
            for (int64_t k = 0; k < Kd; k++) {
                const float xk = x[t * Kd + k];
                for (int64_t c = 0; c < valid; c++) {
                    const float w = bf16 ? bf16_value(b16[k * PANEL + c]) : f32[k * PANEL + c];
                    o[c] = fmaf(xk, w, o[c]);
                }
            }
            for (int64_t c = 0; c < valid; c++) o[c] = o[c] + (bias ? bias[c0 + c] : 0.0f);
        }
#endif
    }
}

/* out [N, C] = x [N, Kd] @ the packed [Kd, C] weight (+ bias [C] unless NULL). */
KERNEL_PRIVATE void matmul_p(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
                             const float *bias, float *out) {
    matmul_panels(x, N, Kd, packed, fmt, C, 0, (C + PANEL - 1) / PANEL, bias, out);
}

/* out [rows, H] = weight * x / sqrt(mean(x^2) + eps), row by row. */
void rms_norm(const float *x, int64_t rows, int64_t H, const float *weight, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * H;
        float inv = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        for (int64_t h = 0; h < H; h++) out[r * H + h] = weight[h] * (xr[h] * inv);
    }
}

/* out [w, V] = x [w, H] @ the packed [H, V] weight Wt, rows independent (matmul_p); the panels split
   over the pool's threads (each reads its own part of the weight). */
struct linear_args { const float *x; int64_t w, H; const void *Wt; int fmt; int64_t V; float *out; };

static void linear_blocks(const void *ctx, int64_t begin, int64_t end) {
    const struct linear_args *a = ctx;
    matmul_panels(a->x, a->w, a->H, a->Wt, a->fmt, a->V, begin, end, NULL, a->out);
}

void linear(const float *x, int64_t w, int64_t H, const void *Wt, int fmt, int64_t V, float *out,
            struct kernel_pool *pool) {
    const struct linear_args a = {x, w, H, Wt, fmt, V, out};
    pool_rows(pool, linear_blocks, &a, (V + PANEL - 1) / PANEL);
}
