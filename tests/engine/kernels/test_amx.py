"""AMX arithmetic (math="amx", csrc/amx.c) where this CPU and kernel offer the tile unit: each row of
a product is bitwise the same alone and in any pass, split over threads or not; its outputs are bf16
arithmetic's up to float32 rounding (the same inputs, the tile unit's own sums); weights whose input
size the tiles cannot take fall back to bf16 arithmetic; and it is refused, naming why, where the
tiles are missing."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import library as kernels
from service.engine.kernels.packed import BF16_AMX, BF16_MATH, PackedWeight, panel_format

_BUILT = kernels.build()
needs_amx = pytest.mark.skipif(_BUILT is None or not _BUILT.amx_native, reason="no AMX tile unit on this CPU or kernel")


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.1


@needs_amx
@pytest.mark.parametrize("in_features", [64, 256, 96])
def test_each_row_is_bitwise_its_own_at_any_row_count_and_split(k, pool, in_features):
    weight = PackedWeight.pack(_weight(200, in_features, 1), BF16_AMX)  # 4 panels, the last partial
    x = torch.randn(37, in_features, generator=torch.Generator().manual_seed(2))  # 2 full tiles and 5 rows
    whole = k.linear(x, weight)
    assert torch.equal(k.linear(x, weight, pool), whole)
    for rows in (slice(0, 1), slice(5, 6), slice(16, 33), slice(36, 37), slice(3, 20)):
        assert torch.equal(k.linear(x[rows].contiguous(), weight), whole[rows]), rows


@needs_amx
def test_outputs_are_bf16_arithmetics_up_to_float32_rounding_and_near_float32(k):
    w, x = _weight(256, 256, 3), torch.randn(20, 256, generator=torch.Generator().manual_seed(4))
    amx = k.linear(x, PackedWeight.pack(w, BF16_AMX))
    bf16 = k.linear(x, PackedWeight.pack(w, BF16_MATH))
    exact = x @ w.T
    assert (amx - bf16).abs().max() <= 1e-5 * exact.abs().max()  # the same rounded inputs, other sums
    assert (amx - exact).abs().max() <= 2e-2 * exact.abs().max()  # bf16 inputs: within bf16's precision


def test_weights_the_tiles_cannot_take_fall_back_to_bf16_arithmetic_and_amx_panels_refuse_them():
    assert panel_format("amx", _weight(8, 64, 5), _weight(8, 256, 6)) == BF16_AMX
    assert panel_format("amx", _weight(8, 64, 5), _weight(8, 40, 6)) == BF16_MATH  # one call, one format
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight.pack(_weight(8, 40, 7), BF16_AMX)


def test_math_amx_without_the_tile_unit_is_refused_naming_why(monkeypatch):
    from service.engine import Engine, EngineConfig, MathUnavailable

    original = kernels.Kernels.__init__

    def without_amx(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.amx_native = False

    monkeypatch.setattr(kernels.Kernels, "__init__", without_amx)
    with pytest.raises(MathUnavailable, match="AMX tile unit"):
        Engine(EngineConfig(threads=1, math="amx"))
