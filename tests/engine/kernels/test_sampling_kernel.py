"""The C sampler (csrc/sampling.c, `Kernels.sample_rows`) against the torch path it replaces for plain
sampled steps: spec/sampling.py's `target_probs` (itself checked against transformers' warpers in
tests/engine/spec/test_sampling_oracle.py) then `sample`'s inverse-CDF draw.

For each row and setting, a grid of uniforms: each must pick the token the torch path's cumulative
distribution gives that uniform, except where the uniform lies within float rounding of a boundary
between two tokens (the two compute exp and the sums apart). Rows are chosen to make the settings
bite: spread and peaked logits, ties at the top-k and top-p boundaries, a logit row of one value."""

from __future__ import annotations

import pytest
import torch

from service.engine.spec.sampling import target_probs
from service.types import SamplingParams

V = 4096
GRID = (torch.arange(2048) + 0.37) / 2048  # uniforms inside (0, 1), off the flat row's boundaries (k / 4096)
SETTINGS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.3, top_k=50), SamplingParams(temperature=1.3, top_k=20, top_p=0.7),
            SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=2.0, top_k=1)]


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(V, generator=g) * 2.0
    peaked = torch.randn(V, generator=g) * 6.0
    ties = torch.randn(V, generator=g).round()  # many equal logits: ties at every boundary
    flat = torch.zeros(V)
    return torch.stack([spread, peaked, ties, flat])


def _torch_tokens(row: torch.Tensor, params: SamplingParams,
                  uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's pick for each uniform, and how far the uniform lies from the nearest boundary."""
    p = target_probs(row[None], params)[0].double()
    cdf = p.cumsum(0)
    total = cdf[-1]
    tokens = torch.searchsorted(cdf, uniforms.double() * total, right=True).clamp(max=V - 1)
    edges = cdf[p > 0] / total
    gap = (uniforms.double()[:, None] - edges[None, :]).abs().amin(1)
    return tokens, gap


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_each_uniform_picks_the_torch_paths_token(k, params):
    for row in _rows():
        want, gap = _torch_tokens(row, params, GRID)
        got = k.sample_rows(row[None].expand(len(GRID), -1).contiguous(), params, GRID.contiguous())
        clear = gap > 1e-5
        assert clear.float().mean() > 0.5  # (most uniforms are checked)
        assert torch.equal(got[clear], want[clear]), (params, (got[clear] != want[clear]).sum())


def test_only_tokens_inside_the_support_are_drawn(k):
    """Every draw of many uniforms lies where the torch path's p is positive (top-k and top-p applied)."""
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.8)
    uniforms = torch.rand(4000, generator=torch.Generator().manual_seed(1))
    for row in _rows():
        p = target_probs(row[None], params)[0]
        got = k.sample_rows(row[None].expand(len(uniforms), -1).contiguous(), params, uniforms)
        assert bool((p[got] > 0).all())


def test_bad_input_is_refused(k):
    with pytest.raises(ValueError, match="greedy"):
        k.sample_rows(torch.zeros(1, V), SamplingParams(temperature=0), torch.zeros(1))
    with pytest.raises(ValueError, match="uniforms"):
        k.sample_rows(torch.zeros(2, V), SamplingParams(), torch.zeros(3))
    with pytest.raises(ValueError, match="logits"):
        k.sample_rows(torch.zeros(2, V, dtype=torch.float64), SamplingParams(), torch.zeros(2))
