"""Fused CPU kernels for the passes of the embedded engine, built from C source at first use.

What is here: the C the kernels share (`dot`, `exp512`, `matmul_p`: register tiles of 4 positions x
64 output columns over a weight packed in 64-column panels, `PackedWeight`: transposed, each panel
contiguous, so there is no horizontal sum per output, each weight streams in order and the positions
that share a weight share each loaded vector), `rms_norm` and `linear`; the ctypes wrappers of every
kernel, with the checks that keep the C code's pointers in bounds; and `build`. Panels hold bf16 where
every value of the weight is one (the shipped checkpoint), widened exactly on load: the same results
as fp32 panels for half the bytes; or, for bf16 arithmetic (math="bf16"), bf16 pairs that VDPBF16PS
multiplies with the rows rounded to bf16 (its C in bf16_kernel.py). A call may split its work over
a `KernelPool`'s threads (kernel_pool.py; `KernelThreads` says when), which changes no bit of the result.

`swiglu_experts(x, gate_up, down, ids, weights, out, accumulate)` and `moe_block(block, x)`: the MoE
kernels; their C source and contract are in moe_kernel.py.

`linear(x, weight)`: x [w, H] @ weight^T for a packed [V, H] weight, with the same row independence
(the output layer).

`attention_block(weights, pass, layer, x)`: a layer's whole attention sub-block for the tokens of a
ragged pass; its C source, contract and argument checks are in attention_kernel.py, compiled into the
same library (it uses `dot`, `exp512`, `matmul_p` and `rms_norm` from here).

The library is compiled with the system C compiler into a cache folder keyed by the source, the
flags and this CPU's feature flags (so a shared home folder never serves code for another CPU), and
loaded with ctypes only once kernel_cache has checked the folder, the file and its recorded SHA-256.
Without a compiler `build` returns None and callers keep the eager path.
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
from pathlib import Path

import torch

from service.engine import attention_kernel, bf16_kernel, kernel_cache, kernel_pool, moe_kernel
from service.engine.attention_kernel import AttentionPass, AttentionWeights
from service.engine.kernel_pool import ONE_THREAD, KernelPool, KernelThreads
from service.engine.moe_kernel import MoeBlock
from service.engine.packed import PackedWeight

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

/* Weights for the products below are packed in panels (`pack_panels`): a [Kd, C] matrix (a weight
   stored transposed) as ceil(C / 64) panels of [Kd, 64], columns past C zero. A tile then streams one
   contiguous panel (a row-major [Kd, C] read 64 columns at a time jumps C floats per k: for the output
   layer 16 KB, a new page every step, which the hardware prefetchers do not follow).

   out[t, c] = sum over k ascending of x[t, k] * w[k, c] (one fused multiply-add per term, from 0),
   then + bias[c]: x [N, Kd], out [N, C]. Every element takes the same arithmetic whatever N is and
   wherever it falls in a tile, so a row's result never depends on the other rows; tiles of 4 rows x 64
   columns (3, 2 or 1 for the rows left over) reuse each loaded weight vector for every row. */
#define PANEL 64
/* Panel formats (`PackedWeight.format`): float32; bf16 values widened exactly (float32 arithmetic); bf16
   pairs with bf16 arithmetic (below). */
#define PANELS_F32 0
#define PANELS_BF16 1
#define PANELS_BF16_MATH 2
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
    STORE_TILE(ROWS)                                                                                   \
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
MATMUL_TILE(f32_tile_4x64, 4, float, LOAD_F32)
MATMUL_TILE(f32_tile_3x64, 3, float, LOAD_F32)
MATMUL_TILE(f32_tile_2x64, 2, float, LOAD_F32)
MATMUL_TILE(f32_tile_1x64, 1, float, LOAD_F32)
MATMUL_TILE(bf16_tile_4x64, 4, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_3x64, 3, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_2x64, 2, uint16_t, LOAD_BF16)
MATMUL_TILE(bf16_tile_1x64, 1, uint16_t, LOAD_BF16)
#endif

"""

# bf16 arithmetic (format-2 panels, bf16_kernel.py): uses the tiles above, matmul_panels below calls it.
_SOURCE += bf16_kernel.SOURCE + r"""
/* Panels [p_begin, p_end) of the product: out's columns 64 p_begin .. min(64 p_end, C). */
static void matmul_panels(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
                          int64_t p_begin, int64_t p_end, const float *bias, float *out) {
    if (fmt == PANELS_BF16_MATH) {
        matmul_panels_bf16_math(x, N, Kd, packed, C, p_begin, p_end, bias, out);
        return;
    }
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
static void matmul_p(const float *x, int64_t N, int64_t Kd, const void *packed, int fmt, int64_t C,
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
"""

_SOURCE += moe_kernel.SOURCE + attention_kernel.SOURCE  # they use the helpers above

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
        self.bf16_dot_native = bool(lib.bf16_dot_native())  # see `default_math`

    def swiglu_experts(self, x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, ids: torch.Tensor,
                       weights: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """See moe_kernel.py. gate_up: packed [E, 2I, H], down: packed [E, H, I]; x, out [w, H],
        ids [w, n] int64, weights [w, n], all contiguous; float32 throughout."""
        (E,), H, I = gate_up.lead, gate_up.in_features, down.in_features
        w, n = ids.shape
        # The C code trusts its pointers: check what would make it read or write out of bounds.
        if not (x.is_contiguous() and out.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
            raise ValueError("swiglu_experts: x, out, ids and weights must be contiguous")
        if gate_up.out_features != 2 * I or down.lead != (E,) or down.out_features != H:
            raise ValueError(f"swiglu_experts: gate_up must be [E, 2I, H] and down [E, H, I], got {gate_up} and {down}")
        if gate_up.format != down.format:
            raise ValueError(f"swiglu_experts: gate_up and down must share one panel format, got {gate_up} and {down}")
        if x.shape != (w, H) or out.shape != (w, H) or weights.shape != (w, n):
            raise ValueError("swiglu_experts: shapes disagree")
        if any(t.dtype != torch.float32 for t in (x, weights, out)) or ids.dtype != torch.int64:
            raise ValueError("swiglu_experts: float32 tensors and int64 ids only")
        if not all(t.is_cpu for t in (x, ids, weights, out)):
            raise ValueError("swiglu_experts: CPU tensors only")
        self._swiglu(x.data_ptr(), w, H, I, gate_up.data_ptr(), gate_up.stride, down.data_ptr(), down.stride,
                     gate_up.format, E, ids.data_ptr(), weights.data_ptr(), n, out.data_ptr(), int(accumulate))

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

    def default_math(self) -> str:
        """The arithmetic of the matrix products where none is asked for: bf16 where this CPU multiplies
        bf16 pairs in one instruction (prefill and batched steps run ~1.3-1.5x faster; logits move ~0.003
        on average from float32's, at most ~2% of their scale), else float32 (bf16 would lose precision
        and gain nothing)."""
        return "bf16" if self.bf16_dot_native else "fp32"

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
        self._linear(x.data_ptr(), x.shape[0], H, weight.data_ptr(), weight.format, V, out.data_ptr(),
                     _handle(pool))
        return out


def _handle(pool: KernelPool | None) -> int | None:
    return None if pool is None else pool.handle


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
    folder = Path(cache_dir) if cache_dir else kernel_cache.default_folder()
    key = hashlib.sha256("\n".join([_SOURCE, *flags, compiler, platform.machine(), _cpu_flags()]).encode())
    try:
        # Checked (owner, permissions, recorded SHA-256) before ctypes runs any of it; see kernel_cache.
        library, scratch = kernel_cache.cached_library(folder, f"swiglu-{key.hexdigest()[:16]}.so",
                                                       lambda path: _compile(compiler, flags, path))
        try:
            return Kernels(library)
        finally:
            if scratch is not None:
                scratch.cleanup()  # the loaded library stays mapped
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the fused expert kernel (%s): the eager path runs", e)
        return None


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
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
