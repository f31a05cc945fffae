"""Fused CPU kernels for short windows (decode steps, verify passes), built from C source at first use.

Why: a decode step of the shipped MoE spends more time moving expert weights than computing with
them, and eager PyTorch moves them three times (index_select copies the touched experts, the matmul
reads the copy) in ~15 small ops per layer. This kernel reads each touched expert's weights once,
in place, for every window position that picked it, and does gate/up, SiLU * up, the routing weight
and down in one call.

Contract of `swiglu_experts(x, gate, up, down, ids, weights, out, accumulate)`:
- x [w, H]; gate and up are the expert-major [E, I, H] halves of the stacked gate/up projections
  (views with any stride between experts), down [E, H, I]; ids [w, n] int64 expert ids per position
  (distinct within a row), weights [w, n] float32 routing weights; out [w, H] float32.
- out[p] (+)= sum over the experts e picked by position p, in ascending e, of
  weights[p, j] * down[e] @ (silu(gate[e] @ x[p]) * (up[e] @ x[p])).
- Each position's result depends only on its own row: it is bitwise the same whatever else is in the
  window, so a verify pass and a plain decode step of the same token agree exactly.
- Experts are visited in ascending id, each read once per call (cost follows the window's union).

`linear(x, weight)`: x [w, H] @ weight [V, H]^T with the same row independence (the output layer).

`attention_block(weights, pass, layer, x)`: a layer's whole attention sub-block for the tokens of a
ragged pass; its C source, contract and argument checks are in attention_kernel.py, compiled into the
same library (it uses `dot` and `rms_norm` from here).

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
from pathlib import Path

import torch

from service.engine import attention_kernel
from service.engine.attention_kernel import AttentionPass, AttentionWeights

__all__ = ["AttentionPass", "AttentionWeights", "Kernels", "MoeBlock", "build"]

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
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

void swiglu_experts(const float *x, int64_t w, int64_t H, int64_t I,
                    const float *gate, const float *up, int64_t gate_up_stride,
                    const float *down, int64_t down_stride, int64_t num_experts,
                    const int64_t *ids, const float *weights, int64_t n, float *out, int accumulate) {
    unsigned char touched[num_experts];
    float act[I];
    memset(touched, 0, (size_t)num_experts);
    if (!accumulate) memset(out, 0, (size_t)(w * H) * sizeof(float));
    for (int64_t j = 0; j < w * n; j++)
        if (ids[j] >= 0 && ids[j] < num_experts) touched[ids[j]] = 1;  /* others are ignored */
    for (int64_t e = 0; e < num_experts; e++) {
        if (!touched[e]) continue;
        const float *g = gate + e * gate_up_stride, *u = up + e * gate_up_stride, *d = down + e * down_stride;
        for (int64_t p = 0; p < w; p++) {
            float r = 0.0f;
            int picked = 0;
            for (int64_t j = 0; j < n; j++)
                if (ids[p * n + j] == e) { r = weights[p * n + j]; picked = 1; }
            if (!picked) continue;
            const float *xp = x + p * H;
            for (int64_t i = 0; i < I; i++) {
                float gi = dot(g + i * H, xp, H);
                act[i] = r * (gi / (1.0f + expf(-gi))) * dot(u + i * H, xp, H);
            }
            float *o = out + p * H;
            for (int64_t h = 0; h < H; h++) o[h] += dot(d + h * I, act, I);
        }
    }
}

/* A whole Qwen2-MoE block for a short window: router (E rows) and shared-expert gate (row E) in one
   pass, softmax over the E router logits, the top m by logit (largest first; softmax keeps the order),
   routing weights = their probabilities (renormalised if norm_topk), the routed experts, then the
   shared expert scaled by sigmoid(its gate). Writes logits [w, E+1], ids [w, m], weights [w, m], out. */
void moe_block(const float *x, int64_t w, int64_t H, const float *router, int64_t E, int64_t m, int norm_topk,
               const float *gate, const float *up, int64_t gate_up_stride, const float *down, int64_t down_stride,
               int64_t I, const float *shared_gate, const float *shared_up, const float *shared_down, int64_t Is,
               float *logits, int64_t *ids, float *weights, float *out) {
    float scale[w];
    int64_t zero[w];
    unsigned char taken[E];
    for (int64_t p = 0; p < w; p++) {
        const float *xp = x + p * H;
        float *l = logits + p * (E + 1);
        for (int64_t e = 0; e <= E; e++) l[e] = dot(router + e * H, xp, H);
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
            ids[p * m + j] = best;
            weights[p * m + j] = expf(l[best] - top) / total;
            picked += weights[p * m + j];
        }
        if (norm_topk)
            for (int64_t j = 0; j < m; j++) weights[p * m + j] /= picked;
        scale[p] = 1.0f / (1.0f + expf(-l[E]));
        zero[p] = 0;
    }
    swiglu_experts(x, w, H, I, gate, up, gate_up_stride, down, down_stride, E, ids, weights, m, out, 0);
    swiglu_experts(x, w, H, Is, shared_gate, shared_up, 0, shared_down, 0, 1, zero, scale, 1, out, 1);
}

/* out [rows, H] = weight * x / sqrt(mean(x^2) + eps), row by row. */
void rms_norm(const float *x, int64_t rows, int64_t H, const float *weight, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * H;
        float inv = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        for (int64_t h = 0; h < H; h++) out[r * H + h] = weight[h] * (xr[h] * inv);
    }
}

/* out [w, V] = x [w, H] @ W [V, H]^T, each weight row read once for every position. */
void linear(const float *x, int64_t w, int64_t H, const float *W, int64_t V, float *out) {
    for (int64_t v = 0; v < V; v++)
        for (int64_t p = 0; p < w; p++) out[p * V + v] = dot(W + v * H, x + p * H, H);
}
"""

_SOURCE += attention_kernel.SOURCE  # uses dot and rms_norm above

_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")


class Kernels:
    """The loaded library; one instance may be shared by every model of a process."""

    def __init__(self, library_path: Path):
        self.path = library_path
        lib = ctypes.CDLL(str(library_path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._swiglu = lib.swiglu_experts
        self._swiglu.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
        self._swiglu.restype = None
        self._linear = lib.linear
        self._linear.argtypes = [ptr, i64, i64, ptr, i64, ptr]
        self._linear.restype = None
        self._moe = lib.moe_block
        self._moe.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, ptr, i64, ptr, i64, i64,
                              ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr]
        self._moe.restype = None
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
        self._rms_norm.restype = None
        self._attention = lib.attention_block
        self._attention.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ptr, i64, i64, i64,
                                    ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        self._attention.restype = None

    def swiglu_experts(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """See the module docstring. gate/up [E, I, H] (rows contiguous), down [E, H, I] contiguous per
        expert; x, out [w, H], ids [w, n] int64, weights [w, n], all contiguous; float32 throughout."""
        E, I, H = gate.shape
        w, n = ids.shape
        # The C code trusts its pointers: check what would make it read or write out of bounds.
        if not (x.is_contiguous() and out.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
            raise ValueError("swiglu_experts: x, out, ids and weights must be contiguous")
        if gate.stride()[1:] != (H, 1) or up.stride() != gate.stride() or down.stride()[1:] != (I, 1):
            raise ValueError("swiglu_experts: expert rows must be contiguous")
        if x.shape != (w, H) or out.shape != (w, H) or weights.shape != (w, n) or down.shape != (E, H, I):
            raise ValueError("swiglu_experts: shapes disagree")
        if any(t.dtype != torch.float32 for t in (x, gate, up, down, weights, out)) or ids.dtype != torch.int64:
            raise ValueError("swiglu_experts: float32 tensors and int64 ids only")
        if not all(t.is_cpu for t in (x, gate, up, down, ids, weights, out)):
            raise ValueError("swiglu_experts: CPU tensors only")
        self._swiglu(x.data_ptr(), w, H, I, gate.data_ptr(), up.data_ptr(), gate.stride(0), down.data_ptr(),
                     down.stride(0), E, ids.data_ptr(), weights.data_ptr(), n, out.data_ptr(), int(accumulate))

    def moe_block(self, block: MoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [w, H] -> (out [w, H], router logits [w, E], routed ids [w, m]) of the block's layer: the
        router, softmax, top-k and both kinds of expert in one call (see the C source)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != block.H or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"moe_block: x must be a contiguous float32 CPU tensor [w, {block.H}]")
        w = x.shape[0]
        logits = x.new_empty(w, block.E + 1)
        ids = torch.empty(w, block.top_k, dtype=torch.long)
        weights = x.new_empty(w, block.top_k)
        out = torch.empty_like(x)
        a = block.args
        self._moe(x.data_ptr(), w, block.H, *a, logits.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                  out.data_ptr())
        return out, logits[:, :-1], ids

    def attention_block(self, weights: AttentionWeights, where: AttentionPass, layer: int,
                        x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (the residual stream) -> x + attention(rms_norm(x)) of one layer, writing the pass's
        keys and values into that layer's cache (see attention_kernel.py)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape != (where.n, weights.H) or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"attention_block: x must be a contiguous float32 CPU tensor [{where.n}, {weights.H}]")
        if (weights.K, weights.D) != (where.K, where.D):
            raise ValueError(f"attention_block: the cache holds {where.K} kv heads of {where.D}, the layer "
                             f"{weights.K} of {weights.D}")
        scratch = x.new_empty(weights.scratch_floats(where.n, where.S))
        out = torch.empty_like(x)
        self._attention(x.data_ptr(), where.n, weights.H, *weights.args, *where.args(layer), weights.o_ptr,
                        scratch.data_ptr(), out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2, -1) + eps) over the last dim of a contiguous float32 CPU x."""
        H = x.shape[-1]
        if x.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu or weight.shape != (H,) \
                or weight.dtype != torch.float32 or not weight.is_contiguous() or not weight.is_cpu:
            raise ValueError(f"rms_norm: x must be contiguous float32 [..., {H}] with a float32 weight [{H}]")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.numel() // H, H, weight.data_ptr(), eps, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [w, H] @ weight [V, H]^T -> [w, V], float32, contiguous; each row of out is bitwise the
        same whatever else is in x (MKL's sgemm blocks differently by w)."""
        V, H = weight.shape
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("linear: weight must be contiguous float32")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"linear: x must be contiguous float32 [w, {H}]")
        if not (x.is_cpu and weight.is_cpu):
            raise ValueError("linear: CPU tensors only")
        out = x.new_empty(x.shape[0], V)
        self._linear(x.data_ptr(), x.shape[0], H, weight.data_ptr(), V, out.data_ptr())
        return out


class MoeBlock:
    """One Qwen2-MoE layer's weights, checked once, for `Kernels.moe_block` (a decode step calls it
    every layer, so the per-call work is only the window's own tensors)."""

    def __init__(self, router_and_gate: torch.Tensor, top_k: int, norm_topk: bool, gate_up: torch.Tensor,
                 down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor):
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
        self.tensors = given  # keeps the storage alive while the pointers below are in use
        row = I * H  # elements between an expert's gate rows and its up rows
        self.args = (router_and_gate.data_ptr(), E, top_k, int(norm_topk), gate_up.data_ptr(),
                     gate_up.data_ptr() + row * 4, gate_up.stride(0), down.data_ptr(), down.stride(0), I,
                     shared_gate.data_ptr(), shared_up.data_ptr(), shared_down.data_ptr(), Is)


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
