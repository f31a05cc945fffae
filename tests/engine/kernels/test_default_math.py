"""The default arithmetic of the matrix products: AMX where the tile unit is there, else bf16 only where
this CPU's bf16 pair instruction computes products markedly faster than float32 FMAs, as measured at
start-up (`bf16_dot_speedup`, csrc/bf16.c), else float32. The probe is 0 without the instruction,
repeatable with it, and sides with the kernels' own products: where a compute-bound product runs
clearly faster in one arithmetic, the probe says so too."""

from __future__ import annotations

import time

import pytest
import torch

from service.engine.kernels.library import BF16_MIN_SPEEDUP, choose_math
from service.engine.kernels.packed import BF16_MATH, F32, PackedWeight


def test_the_rule_takes_amx_then_bf16_only_where_it_pays_then_fp32():
    assert choose_math(True, 0.0) == choose_math(True, 2.0) == "amx"
    assert choose_math(False, 2.0) == choose_math(False, BF16_MIN_SPEEDUP) == "bf16"  # (AMD Zen 4: ~2)
    assert choose_math(False, 1.1) == choose_math(False, 0.5) == "fp32"  # (~0.5 seen on a Xeon without AMX)
    assert choose_math(False, 0.0) == "fp32"  # no instruction


def test_the_probe_is_zero_without_the_instruction_and_repeatable_with_it(kb):
    if not kb.bf16_dot_native:
        assert kb.bf16_dot_speedup() == 0.0
        assert kb.default_math() == ("amx" if kb.amx_native else "fp32")
        return
    readings = [kb.bf16_dot_speedup() for _ in range(5)]
    assert all(0.1 < r < 10 for r in readings)
    assert max(readings) <= 1.3 * min(readings)  # a property of the core, not of the moment
    assert kb.default_math() == choose_math(kb.amx_native, readings[0])


def _best_seconds(k, x, weight, rounds=25) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        k.linear(x, weight)
        best = min(best, time.perf_counter() - started)
    return best


def test_the_probe_sides_with_the_kernels_own_products(k):
    """A compute-bound product (64 rows: a prefill chunk's, the output layer's shape) in float32 and in bf16
    arithmetic, best of 25 each, interleaved: where one is clearly faster (outside 0.8-1.25x), the probe's
    ratio lies on the same side of 1."""
    if not k.bf16_dot_native:
        pytest.skip("this CPU has no bf16 pair instruction: bf16 is never the default")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4096, 256, generator=g) * 0.05, torch.randn(64, 256, generator=g)
    fp32, bf16 = PackedWeight.pack(w, F32), PackedWeight.pack(w, BF16_MATH)
    seconds = {"fp32": [], "bf16": []}
    for _ in range(3):
        seconds["fp32"].append(_best_seconds(k, x, fp32))
        seconds["bf16"].append(_best_seconds(k, x, bf16))
    measured = min(seconds["fp32"]) / min(seconds["bf16"])  # > 1: bf16 products are faster
    probe = k.bf16_dot_speedup()
    if 0.8 <= measured <= 1.25:
        pytest.skip(f"the two arithmetics run within 25% of each other here ({measured:.2f}x): nothing to side with")
    assert (probe > 1) == (measured > 1), (probe, measured)
