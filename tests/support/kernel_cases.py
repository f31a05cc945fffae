"""Sizes, inputs and PyTorch references the fused-kernel tests share (tests/engine/kernels/: test_kernels.py,
test_kernel_pool.py, test_attention_kernel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels import c_build
from service.engine.kernels import library as kernels
from service.engine.kernels.packed import PackedWeight

# Sizes that are not multiples of the SIMD width, so the remainder loops run too.
E, H, I, M = 10, 40, 24, 3


def window(w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:M] for _ in range(w)])  # distinct per row
    weights = torch.rand(w, M, generator=g)
    return x, ids, weights


def reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """Each position through each of its experts with F.linear, the textbook formula."""
    out = torch.zeros_like(x)
    for p in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[p, j])
            g, u = F.linear(x[p], gate_up[e]).chunk(2)
            out[p] += weights[p, j] * F.linear(F.silu(g) * u, down[e])
    return out


def run(k, x, ids, weights, gate_up, down, out=None, accumulate=False) -> torch.Tensor:
    out = torch.zeros_like(x) if out is None else out
    k.swiglu_experts(x, PackedWeight.pack(gate_up), PackedWeight.pack(down), ids, weights, out, accumulate)
    return out


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


IS = 32  # shared expert intermediate


def block_reference(x, bw, norm_topk):
    """Qwen2-MoE's block as transformers writes it: softmax, top-k, routed + sigmoid-gated shared."""
    logits = F.linear(x, bw["router_and_gate"])  # [w, E+1]
    probs = logits[:, :E].softmax(-1)
    weights, ids = probs.topk(M, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    routed = reference(x, ids, weights, bw["gate_up"], bw["down"])
    g, u = F.linear(x, bw["shared_gate"]), F.linear(x, bw["shared_up"])
    shared = F.linear(F.silu(g) * u, bw["shared_down"]) * torch.sigmoid(logits[:, E:])
    return routed + shared, logits[:, :E], ids


# GQA with two query heads per kv head; a hidden size off the SIMD width (remainder loops); 24 cache
# positions, so a token late in a slot attends over one block of 16 keys and part of the next.
AH, AK, AD, AHID, SLOTS, S = 4, 2, 10, 40, 3, 24


def rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # [P, D]
    return angles.cos(), angles.sin()


def attention_reference(x, positions, slots, k_cache, v_cache, w, eps=1e-6):
    """The textbook sub-block, token by token, on copies of the caches (returned updated): RMSNorm,
    q/k/v with F.linear, rope as x cos + rotate_half(x) sin, the cache write, then softmax attention
    of each query head over its kv head's keys 0..position of the token's slot, o_proj, residual."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    D = w["D"]  # noqa: N806 (the shape legend's name)
    cos, sin = rope_tables(S, D)

    def rope(h, p):  # h [heads, D]
        rotated = torch.cat((-h[:, D // 2:], h[:, :D // 2]), dim=-1)
        return h * cos[p] + rotated * sin[p]

    qs = []
    for t in range(x.shape[0]):
        p, s = int(positions[t]), int(slots[t])
        h = w["norm_weight"] * (x[t] * torch.rsqrt(x[t].pow(2).mean() + eps))
        q, k, v = F.linear(h, w["qkv_weight"], w["qkv_bias"]).split([AH * D, AK * D, AK * D])
        qs.append(rope(q.view(AH, D), p))
        k_cache[0, s, :, p] = rope(k.view(AK, D), p)
        v_cache[0, s, :, p] = v.view(AK, D)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        p, s = int(positions[t]), int(slots[t])
        heads = []
        for a in range(AH):
            kv = a // (AH // AK)
            keys, values = k_cache[0, s, kv, :p + 1], v_cache[0, s, kv, :p + 1]  # [p+1, D]
            heads.append(torch.softmax(keys @ qs[t][a] / D ** 0.5, dim=0) @ values)
        out[t] = x[t] + F.linear(torch.cat(heads), w["o_weight"])
    return out, k_cache, v_cache


def ragged_pass(windows: list[tuple[int, int, int]], seed: int, D: int = AD):  # noqa: N803
    """windows (slot, start, length) -> x [N, AHID], positions [N], slots [N] and caches [1, SLOTS, K, S, D]
    full of random keys/values (the prefixes every window attends to, and stale entries past them)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in windows])
    slots = torch.cat([torch.full((n,), slot) for slot, _, n in windows])
    caches = [torch.randn(1, SLOTS, AK, S, D, generator=g) for _ in range(2)]
    return torch.randn(positions.shape[0], AHID, generator=g), positions, slots, *caches


def run_attention(ka, w, x, positions, slots, k_cache, v_cache, pool=None, kv_only=False):
    """The kernel on the given caches (written in place) -> out [N, AHID] (None when kv_only)."""
    weights = kernels.AttentionWeights(w["norm_weight"], 1e-6, w["qkv_weight"], w["qkv_bias"], w["o_weight"],
                                       AH, AK, w["D"])
    where = kernels.AttentionPass(positions, slots, k_cache, v_cache, *rope_tables(S, w["D"]))
    return ka.attention_block(weights, where, 0, x, pool, kv_only=kv_only)


# A window at position 0, one at position 1, a verify window after a long prefix, and a ragged pass of
# three slots with different starts and lengths (one of them a prefill from position 0).
PASSES = {"first-position": [(0, 0, 1)], "second-position": [(1, 1, 1)], "long-prefix": [(2, 19, 5)],
          "ragged": [(2, 7, 3), (0, 0, 6), (1, 15, 1)]}

# The builds a CPU may get, as flags after the native ones: portable C (no AVX-512 tiles, no AVX2 or
# FMA for the compiler to vectorise with), AVX2 with FMA (the portable loops, vectorised by the
# compiler), AVX-512 without its bf16 instructions.
PORTABLE = c_build.PORTABLE_FLAGS
AVX2 = ("-mno-avx512f", *c_build.NO_AMX_FLAGS)  # CPUs without AVX-512 have no AMX either
AVX512_WITHOUT_BF16 = ("-mno-avx512bf16", *c_build.NO_AMX_FLAGS)


def cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False
