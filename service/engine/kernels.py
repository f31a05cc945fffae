"""Fused CPU kernels for the passes of the embedded engine, built from C source at first use.

Why: a decode step of the shipped MoE spends more time moving expert weights than computing with
them, and eager PyTorch moves them three times (index_select copies the touched experts, the matmul
reads the copy) in ~15 small ops per layer. This kernel reads each touched expert's weights once per
call, for every position that picked it, and does gate/up, SiLU * up, the routing weight and down in
one call. Every product is `matmul_p`: register tiles of 4 positions x 64 output columns over a
weight packed in 64-column panels (`PackedWeight`: transposed, each panel contiguous), so there is no
horizontal sum per output, each weight streams in order, and the positions that share an expert
share each loaded weight vector (a batched pass of many requests, a long prompt). Panels hold bf16
where every value of the weight is one (the shipped checkpoint), widened exactly on load: the same
results as fp32 panels for half the bytes. A call may split its positions (the output layer: its
columns) over a `KernelPool`'s threads (kernel_pool.py), which changes no bit of the result.

Contract of `swiglu_experts(x, gate_up, down, ids, weights, out, accumulate)`:
- x [w, H]; gate_up: the experts' stacked gate and up projections [E, 2I, H] (gate rows, then up) and
  down [E, H, I], both as `PackedWeight`s; ids [w, n] int64 expert ids per position (distinct within a
  row), weights [w, n] float32 routing weights; out [w, H] float32.
- out[p] (+)= sum over the experts e picked by position p, in ascending e, of
  weights[p, j] * down[e] @ (silu(gate[e] @ x[p]) * (up[e] @ x[p])).
- Each position's result depends only on its own row: every element is a sum over k ascending of
  fused multiply-adds from zero, whatever else is in the window and wherever the position falls in a
  tile, so it is bitwise the same alone or in any pass (a verify pass and a plain decode step of the
  same token agree exactly).
- Experts are visited in ascending id, each read once per 16 positions that picked it (its weights
  stay in L2 across the chunks; cost follows the window's union).

`linear(x, weight)`: x [w, H] @ weight^T for a packed [V, H] weight, with the same row independence
(the output layer).

`attention_block(weights, pass, layer, x)`: a layer's whole attention sub-block for the tokens of a
ragged pass; its C source, contract and argument checks are in attention_kernel.py, compiled into the
same library (it uses `dot`, `matmul_p` and `rms_norm` from here).

The library is compiled with the system C compiler into a cache folder keyed by the source, the
flags and this CPU's feature flags (so a shared home folder never serves code for another CPU), and
loaded with ctypes. Without a compiler `build` returns None and callers keep the eager path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from service.engine import attention_kernel, kernel_pool
from service.engine.attention_kernel import AttentionPass, AttentionWeights
from service.engine.kernel_pool import KernelPool
from service.engine.packed import PackedWeight, holds_bf16

__all__ = ["AttentionPass", "AttentionWeights", "KernelThreads", "Kernels", "MoeBlock", "ONE_THREAD", "PackedWeight",
           "build"]

log = logging.getLogger(__name__)

_SOURCE = kernel_pool.SOURCE + r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
/* Two independent FMA chains, one tree reduction per dot: most rows here are 64 or 256 long. */
static float dot(const float *a, const float *b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), acc1);
    }
    for (; k + 16 <= n; k += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#else
/* Portable: 16 independent partial sums the compiler can keep in SIMD registers without being
   allowed to reorder a single sum (no -ffast-math). */
#define LANES 16
static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#endif

#if defined(__AVX512F__)
/* e^x for 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, then
   2^n by vscalefps): within ~2 ulp of expf, and about 10x faster than glibc's scalar expf, which
   SiLU calls for every intermediate unit of every expert a position picked (a 1,520-token prefill:
   1.2 M calls per layer). Every lane takes the same arithmetic, so results stay row independent. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* act[i] = r * silu(g[i]) * u[i] for i < I (SiLU(g) = g / (1 + e^-g)). */
static void swiglu_act(const float *g, const float *u, float r, int64_t I, float *act) {
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

/* Weights for the products below are packed in panels (`pack_panels`): a [Kd, C] matrix (a weight
   stored transposed) as ceil(C / 64) panels of [Kd, 64], columns past C zero. A tile then streams one
   contiguous panel (a row-major [Kd, C] read 64 columns at a time jumps C floats per k: for the output
   layer 16 KB, a new page every step, which the hardware prefetchers do not follow).

   out[t, c] = sum over k ascending of x[t, k] * w[k, c] (one fused multiply-add per term, from 0),
   then + bias[c]: x [N, Kd], out [N, C]. Every element takes the same arithmetic whatever N is and
   wherever it falls in a tile, so a row's result never depends on the other rows; tiles of 4 rows x 64
   columns (3, 2 or 1 for the rows left over) reuse each loaded weight vector for every row. */
#define PANEL 64
/* A panel's weights are float32, or bfloat16 (bf16 != 0) when the weight holds only bf16 values (the
   shipped checkpoint is bf16): widened to the same float32 on load, exactly, so the product is bitwise
   the one from float32 panels for half the bytes a pass reads. */
static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#define LOAD_F32(p) _mm512_loadu_ps(p)
#define LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* A ROWS x 64 tile of out from one panel of W-typed weights, its accumulators in registers; only the
   `valid` first columns are stored (the last panel of a C that is not a multiple of 64). */
#define MATMUL_TILE(NAME, ROWS, W, LOAD)                                                               \
static void NAME(const float *x, int64_t Kd, const W *panel, int64_t C, int64_t c0, int64_t valid,      \
                 const float *bias, float *out) {                                                      \
    __m512 acc[ROWS][4];                                                                               \
    for (int i = 0; i < ROWS; i++)                                                                     \
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();                                  \
    for (int64_t k = 0; k < Kd; k++) {                                                                 \
        __m512 wv[4];                                                                                  \
        for (int v = 0; v < 4; v++) wv[v] = LOAD(panel + k * PANEL + 16 * v);                          \
        for (int i = 0; i < ROWS; i++) {                                                               \
            const __m512 xb = _mm512_set1_ps(x[i * Kd + k]);                                           \
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xb, wv[v], acc[i][v]);             \
        }                                                                                              \
    }                                                                                                  \
    for (int v = 0; v < 4; v++) {                                                                      \
        const int64_t left = valid - 16 * v;                                                           \
        if (left <= 0) break;                                                                          \
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);         \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c0 + 16 * v) : _mm512_setzero_ps(); \
        for (int i = 0; i < ROWS; i++)                                                                 \
            _mm512_mask_storeu_ps(out + i * C + c0 + 16 * v, keep, _mm512_add_ps(acc[i][v], b));       \
    }                                                                                                  \
}
/* 2- and 3-row tiles for the rows left over: in a batched step most experts serve 1-3 positions,
   which would otherwise reload each weight vector once per row. */
MATMUL_TILE(tile_4x64, 4, float, LOAD_F32)
MATMUL_TILE(tile_3x64, 3, float, LOAD_F32)
MATMUL_TILE(tile_2x64, 2, float, LOAD_F32)
MATMUL_TILE(tile_1x64, 1, float, LOAD_F32)
MATMUL_TILE(tile_4x64_bf16, 4, uint16_t, LOAD_BF16)
MATMUL_TILE(tile_3x64_bf16, 3, uint16_t, LOAD_BF16)
MATMUL_TILE(tile_2x64_bf16, 2, uint16_t, LOAD_BF16)
MATMUL_TILE(tile_1x64_bf16, 1, uint16_t, LOAD_BF16)
#endif

/* Panels [p_begin, p_end) of the product: out's columns 64 p_begin .. min(64 p_end, C). */
static void matmul_panels(const float *x, int64_t N, int64_t Kd, const void *packed, int bf16, int64_t C,
                          int64_t p_begin, int64_t p_end, const float *bias, float *out) {
    for (int64_t p = p_begin; p < p_end; p++) {
        const int64_t at = p * Kd * PANEL, c0 = p * PANEL, valid = C - c0 < PANEL ? C - c0 : PANEL;
        const float *f32 = (const float *)packed + at;
        const uint16_t *b16 = (const uint16_t *)packed + at;
#if defined(__AVX512F__)
        int64_t t = 0;
        if (bf16) {
            for (; t + 4 <= N; t += 4) tile_4x64_bf16(x + t * Kd, Kd, b16, C, c0, valid, bias, out + t * C);
            if (N - t == 3) tile_3x64_bf16(x + t * Kd, Kd, b16, C, c0, valid, bias, out + t * C);
            if (N - t == 2) tile_2x64_bf16(x + t * Kd, Kd, b16, C, c0, valid, bias, out + t * C);
            if (N - t == 1) tile_1x64_bf16(x + t * Kd, Kd, b16, C, c0, valid, bias, out + t * C);
        } else {
            for (; t + 4 <= N; t += 4) tile_4x64(x + t * Kd, Kd, f32, C, c0, valid, bias, out + t * C);
            if (N - t == 3) tile_3x64(x + t * Kd, Kd, f32, C, c0, valid, bias, out + t * C);
            if (N - t == 2) tile_2x64(x + t * Kd, Kd, f32, C, c0, valid, bias, out + t * C);
            if (N - t == 1) tile_1x64(x + t * Kd, Kd, f32, C, c0, valid, bias, out + t * C);
        }
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
static void matmul_p(const float *x, int64_t N, int64_t Kd, const void *packed, int bf16, int64_t C,
                     const float *bias, float *out) {
    matmul_panels(x, N, Kd, packed, bf16, C, 0, (C + PANEL - 1) / PANEL, bias, out);
}

/* Positions per tile pass through one expert: the scratch below lives on the stack (~80 KB for the
   shipped model's shared expert), and an expert's weights stay in L2 across the chunks of a long pass. */
#define ROW_CHUNK 16

/* One expert over up to ROW_CHUNK gathered positions: y[q] = down^T (r[q] silu(g) * u), [g | u] =
   x_{rows[q]} gate_up^T, y [np, H]. Every product is matmul_p's, so each row's arithmetic is its own. */
static void expert_apply(const float *x, int64_t H, int64_t I, const void *gate_up_t, const void *down_t, int bf16,
                         const int64_t *rows, const float *r, int64_t np, float *y) {
    float xs[ROW_CHUNK * H], gu[ROW_CHUNK * 2 * I], act[ROW_CHUNK * I];
    for (int64_t q = 0; q < np; q++) memcpy(xs + q * H, x + rows[q] * H, (size_t)H * sizeof(float));
    matmul_p(xs, np, H, gate_up_t, bf16, 2 * I, NULL, gu);
    for (int64_t q = 0; q < np; q++) swiglu_act(gu + q * 2 * I, gu + q * 2 * I + I, r[q], I, act + q * I);
    matmul_p(act, np, I, down_t, bf16, H, NULL, y);
}

/* expert_apply, then out[rows[q]] += y[q]. */
static void expert_rows(const float *x, int64_t H, int64_t I, const void *gate_up_t, const void *down_t, int bf16,
                        const int64_t *rows, const float *r, int64_t np, float *out) {
    float y[ROW_CHUNK * H];
    expert_apply(x, H, I, gate_up_t, down_t, bf16, rows, r, np, y);
    for (int64_t q = 0; q < np; q++) {
        float *o = out + rows[q] * H;
        for (int64_t h = 0; h < H; h++) o[h] += y[q * H + h];
    }
}

/* p + elements weights of the panels' type. */
static const void *weights_at(const void *p, int64_t elements, int bf16) {
    return (const char *)p + elements * (bf16 ? 2 : 4);
}

/* gate_up_t / down_t: every expert's packed panels, gate_up_stride / down_stride weights apart; bf16:
   their type (see bf16_value). */
void swiglu_experts(const float *x, int64_t w, int64_t H, int64_t I, const void *gate_up_t,
                    int64_t gate_up_stride, const void *down_t, int64_t down_stride, int bf16, int64_t num_experts,
                    const int64_t *ids, const float *weights, int64_t n, float *out, int accumulate) {
    int64_t count[num_experts + 1];
    int64_t *rows = malloc((size_t)(w * n + 1) * sizeof(int64_t));
    float *r = malloc((size_t)(w * n + 1) * sizeof(float));
    if (!rows || !r) { free(rows); free(r); return; }  /* (the Python side allocates far more than this) */
    if (!accumulate) memset(out, 0, (size_t)(w * H) * sizeof(float));
    /* Counting sort of the (position, weight) pairs by expert, positions ascending within an expert. */
    memset(count, 0, (size_t)(num_experts + 1) * sizeof(int64_t));
    for (int64_t j = 0; j < w * n; j++)
        if (ids[j] >= 0 && ids[j] < num_experts) count[ids[j] + 1]++;  /* others are ignored */
    for (int64_t e = 0; e < num_experts; e++) count[e + 1] += count[e];
    for (int64_t j = 0; j < w * n; j++)
        if (ids[j] >= 0 && ids[j] < num_experts) {
            const int64_t at = count[ids[j]]++;
            rows[at] = j / n;
            r[at] = weights[j];
        }
    for (int64_t e = 0, first = 0; e < num_experts; first = count[e], e++)  /* count[e] is now e's end */
        for (int64_t c = first; c < count[e]; c += ROW_CHUNK)
            expert_rows(x, H, I, weights_at(gate_up_t, e * gate_up_stride, bf16),
                        weights_at(down_t, e * down_stride, bf16), bf16, rows + c, r + c,
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
    const void *shared_gate_up_t, *shared_down_t; int64_t Is; int bf16;
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
    swiglu_experts(x, w, H, a->I, a->gate_up_t, a->gate_up_stride, a->down_t, a->down_stride, a->bf16, a->E,
                   a->ids + begin * m, a->weights + begin * m, m, out, 0);
    swiglu_experts(x, w, H, a->Is, a->shared_gate_up_t, 0, a->shared_down_t, 0, a->bf16, 1, zero, a->scale + begin,
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
            expert_apply(a->x, a->H, a->Is, a->shared_gate_up_t, a->shared_down_t, a->bf16, b->positions + it->first,
                         a->scale + it->first, it->count, b->y_shared + it->first * a->H);
        else
            expert_apply(a->x, a->H, a->I, weights_at(a->gate_up_t, it->expert * a->gate_up_stride, a->bf16),
                         weights_at(a->down_t, it->expert * a->down_stride, a->bf16), a->bf16, b->rows + it->first,
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
    int64_t *ints = malloc((size_t)(3 * pairs + w + 1) * sizeof(int64_t));
    struct moe_unit *units = malloc((size_t)(pairs + w + 1) * sizeof(struct moe_unit));
    float *floats = malloc((size_t)(pairs + (pairs + w) * H + 1) * sizeof(float));
    if (!ints || !units || !floats) { free(ints); free(units); free(floats); return 0; }
    int64_t *rows = ints, *slot = rows + pairs, *positions = slot + pairs, count[E + 1];
    float *r = floats;
    pool_rows(pool, moe_route_rows, a, w);
    /* Counting sort of the (position, weight) pairs by expert, positions ascending within an expert. */
    memset(count, 0, sizeof count);
    for (int64_t j = 0; j < pairs; j++) count[a->ids[j] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    for (int64_t j = 0; j < pairs; j++) {
        const int64_t at = count[a->ids[j]]++;
        rows[at] = j / m;
        r[at] = a->weights[j];
        slot[j] = at;
    }
    int64_t n = 0;
    for (int64_t p = 0; p < w; p++) positions[p] = p;
    for (int64_t p = 0; p < w; p += ROW_CHUNK)  /* the shared expert first: the biggest units */
        units[n++] = (struct moe_unit){-1, p, w - p < ROW_CHUNK ? w - p : ROW_CHUNK};
    for (int64_t e = 0, first = 0; e < E; first = count[e], e++)  /* count[e] is now e's end */
        for (int64_t c = first; c < count[e]; c += ROW_CHUNK)
            units[n++] = (struct moe_unit){e, c, count[e] - c < ROW_CHUNK ? count[e] - c : ROW_CHUNK};
    struct moe_by_expert b = {a, rows, slot, positions, r, units, n, 0, floats + pairs, floats + pairs + pairs * H};
    const int64_t threads = pool ? pool->workers + 1 : 1;
    pool_rows(pool, moe_units, &b, threads);  /* one range per thread, each taking units until none is left */
    pool_rows(pool, moe_sum_rows, &b, w);
    free(ints);
    free(units);
    free(floats);
    return 1;
}

/* pool: the threads a pass is split over (NULL: this thread alone): a short pass by expert, a long one by
   position (see moe_block_by_expert); either way bitwise the one-thread result. */
void moe_block(const float *x, int64_t w, int64_t H, const float *router, int64_t E, int64_t m, int norm_topk,
               const void *gate_up_t, int64_t gate_up_stride, const void *down_t, int64_t down_stride, int64_t I,
               const void *shared_gate_up_t, const void *shared_down_t, int64_t Is, int bf16,
               float *logits, int64_t *ids, float *weights, float *out, float *scale, struct kernel_pool *pool) {
    const struct moe_args a = {x, H, router, E, m, norm_topk, gate_up_t, gate_up_stride, down_t, down_stride, I,
                               shared_gate_up_t, shared_down_t, Is, bf16, logits, ids, weights, out, scale};
    if (pool != NULL && w <= EXPERT_SPLIT_MAX && moe_block_by_expert(&a, w, pool)) return;
    pool_rows(pool, moe_rows, &a, w);
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
struct linear_args { const float *x; int64_t w, H; const void *Wt; int bf16; int64_t V; float *out; };

static void linear_blocks(const void *ctx, int64_t begin, int64_t end) {
    const struct linear_args *a = ctx;
    matmul_panels(a->x, a->w, a->H, a->Wt, a->bf16, a->V, begin, end, NULL, a->out);
}

void linear(const float *x, int64_t w, int64_t H, const void *Wt, int bf16, int64_t V, float *out,
            struct kernel_pool *pool) {
    const struct linear_args a = {x, w, H, Wt, bf16, V, out};
    pool_rows(pool, linear_blocks, &a, (V + PANEL - 1) / PANEL);
}
"""

_SOURCE += attention_kernel.SOURCE  # uses dot and rms_norm above

_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-pthread")


class Kernels:
    """The loaded library; one instance may be shared by every model of a process."""

    def __init__(self, library_path: Path):
        self.path = library_path
        lib = ctypes.CDLL(str(library_path))
        kernel_pool.bind(lib)
        self._lib = lib
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._swiglu = lib.swiglu_experts
        self._swiglu.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, i64, ptr, ptr, i64, ptr,
                                 ctypes.c_int]
        self._swiglu.restype = None
        self._linear = lib.linear
        self._linear.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr]
        self._linear.restype = None
        self._moe = lib.moe_block
        self._moe.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, ptr, i64, i64,
                              ptr, ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ptr]
        self._moe.restype = None
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
        self._rms_norm.restype = None
        self._attention = lib.attention_block
        self._attention.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ptr, i64, i64, i64, ctypes.c_int,
                                    ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
        self._attention.restype = None

    def swiglu_experts(self, x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, ids: torch.Tensor,
                       weights: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """See the module docstring. gate_up: packed [E, 2I, H], down: packed [E, H, I]; x, out [w, H],
        ids [w, n] int64, weights [w, n], all contiguous; float32 throughout."""
        (E,), H, I = gate_up.lead, gate_up.in_features, down.in_features
        w, n = ids.shape
        # The C code trusts its pointers: check what would make it read or write out of bounds.
        if not (x.is_contiguous() and out.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
            raise ValueError("swiglu_experts: x, out, ids and weights must be contiguous")
        if gate_up.out_features != 2 * I or down.lead != (E,) or down.out_features != H or gate_up.bf16 != down.bf16:
            raise ValueError(f"swiglu_experts: gate_up must be [E, 2I, H] and down [E, H, I], got {gate_up} and {down}")
        if x.shape != (w, H) or out.shape != (w, H) or weights.shape != (w, n):
            raise ValueError("swiglu_experts: shapes disagree")
        if any(t.dtype != torch.float32 for t in (x, weights, out)) or ids.dtype != torch.int64:
            raise ValueError("swiglu_experts: float32 tensors and int64 ids only")
        if not all(t.is_cpu for t in (x, ids, weights, out)):
            raise ValueError("swiglu_experts: CPU tensors only")
        self._swiglu(x.data_ptr(), w, H, I, gate_up.data_ptr(), gate_up.stride, down.data_ptr(), down.stride,
                     int(gate_up.bf16), E, ids.data_ptr(), weights.data_ptr(), n, out.data_ptr(), int(accumulate))

    def moe_block(self, block: MoeBlock, x: torch.Tensor,
                  pool: KernelPool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [w, H] -> (out [w, H], router logits [w, E], routed ids [w, m]) of the block's layer: the
        router, softmax, top-k and both kinds of expert in one call (see the C source), its positions
        split over the pool's threads if one is given (bitwise the same result)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != block.H or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"moe_block: x must be a contiguous float32 CPU tensor [w, {block.H}]")
        w = x.shape[0]
        logits = x.new_empty(w, block.E + 1)
        ids = torch.empty(w, block.top_k, dtype=torch.long)
        weights = x.new_empty(w, block.top_k)
        out = torch.empty_like(x)
        scale = x.new_empty(w)  # each position's shared-expert scale (the kernel's scratch)
        a = block.args
        self._moe(x.data_ptr(), w, block.H, *a, logits.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                  out.data_ptr(), scale.data_ptr(), _handle(pool))
        return out, logits[:, :-1], ids

    def attention_block(self, weights: AttentionWeights, where: AttentionPass, layer: int,
                        x: torch.Tensor, pool: KernelPool | None = None, kv_only: bool = False) -> torch.Tensor | None:
        """x [N, H] (the residual stream) -> x + attention(rms_norm(x)) of one layer, writing the pass's
        keys and values into that layer's cache (see attention_kernel.py); its tokens split over the
        pool's threads if one is given (bitwise the same result). kv_only: write the keys and values
        (bitwise the same) and return None."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape != (where.n, weights.H) or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"attention_block: x must be a contiguous float32 CPU tensor [{where.n}, {weights.H}]")
        if (weights.K, weights.D) != (where.K, where.D):
            raise ValueError(f"attention_block: the cache holds {where.K} kv heads of {where.D}, the layer "
                             f"{weights.K} of {weights.D}")
        scratch = x.new_empty(weights.scratch_floats(where.n))
        out = torch.empty_like(x)
        self._attention(x.data_ptr(), where.n, weights.H, *weights.args, *where.args(layer), weights.o_ptr,
                        scratch.data_ptr(), out.data_ptr(), _handle(pool), int(kv_only))
        return None if kv_only else out

    def pool(self, threads: int) -> KernelPool:
        """Start `threads - 1` workers for this library's calls to split over (see kernel_pool.py)."""
        return KernelPool(self._lib, threads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2, -1) + eps) over the last dim of a contiguous float32 CPU x."""
        H = x.shape[-1]
        if x.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu or weight.shape != (H,) \
                or weight.dtype != torch.float32 or not weight.is_contiguous() or not weight.is_cpu:
            raise ValueError(f"rms_norm: x must be contiguous float32 [..., {H}] with a float32 weight [{H}]")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.numel() // H, H, weight.data_ptr(), eps, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, weight: PackedWeight, pool: KernelPool | None = None) -> torch.Tensor:
        """x [w, H] @ weight^T (a packed [V, H] weight) -> [w, V], float32, contiguous; each row of out
        is bitwise the same whatever else is in x (MKL's sgemm blocks differently by w); the output
        columns split over the pool's threads if one is given (bitwise the same result)."""
        H, V = weight.in_features, weight.out_features
        if weight.lead:
            raise ValueError(f"linear: weight must be one packed [V, H] matrix, got {weight}")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"linear: x must be contiguous float32 [w, {H}]")
        if not x.is_cpu:
            raise ValueError("linear: CPU tensors only")
        out = x.new_empty(x.shape[0], V)
        self._linear(x.data_ptr(), x.shape[0], H, weight.data_ptr(), int(weight.bf16), V, out.data_ptr(),
                     _handle(pool))
        return out


@dataclass(frozen=True)
class KernelThreads:
    """When a kernel call splits its work over the pool's threads: from a kernel's minimum number of
    positions in the pass on (no pool: never). Splitting never changes a bit of the result (every
    position and output column is computed on its own). The MoE block and attention need 2 positions;
    the output layer splits its columns, so even one position pays. Measured on the 2-core development
    machine (AMD EPYC, in-process, shipped model, a warm pool of 2, ms per call, 1 -> 2 threads): MoE
    block 1.14 -> 0.81 at 16 positions (split by position; by expert, the C source, 0.20 against 0.21 on
    recorded calls at a later, faster moment); attention 0.076 -> 0.049 at 2 and 0.30 -> 0.20 at 16;
    output layer 0.077 -> 0.046 at 1 and 0.45 -> 0.34 at 16. A single position: attention has nothing
    to split (0.047 -> 0.049); the MoE block split by expert took 0.035 against 0.052 ms on replayed
    calls, but real single-stream decoding gained nothing (two engines alternating, 4 runs of 12 rounds:
    median per-round ratio 0.91, 1.04, 0.96, 1.00), and a split step also waits for the other thread to
    wake, so one position stays on one thread."""

    pool: KernelPool | None = None
    moe_min_positions: int = 2
    linear_min_positions: int = 1
    attention_min_positions: int = 2

    @property
    def threads(self) -> int:
        return self.pool.threads if self.pool is not None else 1

    def moe(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.moe_min_positions else None

    def linear(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.linear_min_positions else None

    def attention(self, positions: int) -> KernelPool | None:
        return self.pool if positions >= self.attention_min_positions else None

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.threads == 1:
            return "kernel threads: 1 (no pass is split)"
        moe = self.moe_min_positions
        return (f"kernel threads: {self.threads} (a pass's work splits over them from {moe} "
                f"position{'s' if moe != 1 else ''} in the MoE block, {self.linear_min_positions} in the output layer, "
                f"{self.attention_min_positions} in attention)")


def _handle(pool: KernelPool | None) -> int | None:
    return None if pool is None else pool.handle


ONE_THREAD = KernelThreads()  # no call is split (frozen: a safe default)


class MoeBlock:
    """One Qwen2-MoE layer's weights, checked once, for `Kernels.moe_block` (a decode step calls it
    every layer, so the per-call work is only the window's own tensors)."""

    def __init__(self, router_and_gate: torch.Tensor, top_k: int, norm_topk: bool, gate_up: torch.Tensor,
                 down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                 bf16: bool | None = None):
        """router_and_gate [E+1, H] (router rows, then the shared expert's gate row); gate_up [E, 2I, H];
        down [E, H, I]; shared_gate / shared_up [Is, H]; shared_down [H, Is]. Contiguous float32 CPU."""
        E, H = router_and_gate.shape[0] - 1, router_and_gate.shape[1]
        I, Is = gate_up.shape[1] // 2, shared_gate.shape[0]
        expected = {"router_and_gate": (E + 1, H), "gate_up": (E, 2 * I, H), "down": (E, H, I),
                    "shared_gate": (Is, H), "shared_up": (Is, H), "shared_down": (H, Is)}
        given = dict(router_and_gate=router_and_gate, gate_up=gate_up, down=down, shared_gate=shared_gate,
                     shared_up=shared_up, shared_down=shared_down)
        for name, t in given.items():
            if tuple(t.shape) != expected[name] or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"moe_block: {name} must be a contiguous float32 CPU tensor {expected[name]}")
        if not 1 <= top_k <= E:
            raise ValueError(f"moe_block: top_k must be in [1, {E}], got {top_k}")
        self.E, self.H, self.I, self.Is, self.top_k, self.norm_topk = E, H, I, Is, top_k, norm_topk
        # The kernel's layout (packed copies); these and the tensors given stay referenced while the
        # pointers below are in use.
        shared_gate_up = torch.cat([shared_gate, shared_up])
        # One type for all its packed weights (one kernel flag): bf16 where exact, unless told (see PackedWeight).
        self.bf16 = holds_bf16(gate_up, down, shared_gate_up, shared_down) if bf16 is None else bf16
        packed = {name: PackedWeight.pack(w, self.bf16) for name, w in
                  dict(gate_up=gate_up, down=down, shared_gate_up=shared_gate_up, shared_down=shared_down).items()}
        self.tensors = dict(given, **packed)
        self.args = (router_and_gate.data_ptr(), E, top_k, int(norm_topk), packed["gate_up"].data_ptr(),
                     packed["gate_up"].stride, packed["down"].data_ptr(), packed["down"].stride, I,
                     packed["shared_gate_up"].data_ptr(), packed["shared_down"].data_ptr(), Is, int(self.bf16))


def build(cache_dir: Path | None = None, compiler: str | None = None,
          extra_flags: tuple[str, ...] = ()) -> Kernels | None:
    """Compile (or reuse) the library and load it; None, with one warning, when it cannot be built.

    cache_dir defaults to ~/.cache/moespec/kernels, compiler to `cc` on the PATH; extra_flags go after
    the default flags (tests build the portable code with `-mno-avx512f`).
    """
    flags = (*_FLAGS, *extra_flags)
    compiler = compiler or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler on the PATH: the fused expert kernel is off, the eager path runs")
        return None
    folder = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "moespec" / "kernels"
    key = hashlib.sha256("\n".join([_SOURCE, *flags, compiler, platform.machine(), _cpu_flags()]).encode())
    library = folder / f"swiglu-{key.hexdigest()[:16]}.so"
    try:
        if not library.is_file():
            _compile(compiler, flags, library)
        return Kernels(library)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the fused expert kernel (%s): the eager path runs", e)
        return None


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        source = Path(tmp) / "swiglu.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / library.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: a concurrent builder never loads half a file


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
