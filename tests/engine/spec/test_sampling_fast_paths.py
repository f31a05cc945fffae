"""The sampling fast paths give exactly what the plain computations give: the top-p cutoff from
numpy's sort and the top-k threshold from numpy's partition equal torch's sort and topk (ties,
flat rows, several rows), a pass's sampled requests' distributions computed together are bitwise
each one's alone, and the inverse-CDF draw follows its distribution and never draws a token of
probability 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from service.engine.spec.acceptance import sampled_probs
from service.engine.spec.sampling import _kth_largest, _top_p_cutoff, sample, target_probs
from service.types import GenerationRequest, SamplingParams
from tests.support.engine_helpers import fit_pvalue


def full_sort_cutoff(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p = probs.sort(-1, descending=True).values
    kept = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return sorted_p.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # 0.3: flat rows, most of the vocabulary kept
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_the_cutoff_equals_torchs_full_sort_cutoff(scale, top_p):
    g = torch.Generator().manual_seed(int(scale * 10) + int(top_p * 1000))
    for tied in (False, True):
        logits = torch.randn(4, 4096, generator=g) * scale
        probs = (logits.round() if tied else logits).softmax(-1)
        assert torch.equal(_top_p_cutoff(probs, top_p), full_sort_cutoff(probs, top_p))


def test_flat_rows_take_the_full_sort():
    probs = torch.full((2, 4096), 1 / 4096)
    assert (probs >= _top_p_cutoff(probs, 0.95)).sum() == 2 * 4096  # every tied token stays


@pytest.mark.parametrize("k", [1, 50, 4095])
def test_the_top_k_threshold_equals_torchs_topk(k):
    g = torch.Generator().manual_seed(k)
    for tied in (False, True):
        logits = torch.randn(3, 4096, generator=g) * 3
        logits = logits.round() if tied else logits
        assert torch.equal(_kth_largest(logits, k), logits.topk(k, dim=-1).values[..., -1:])


def test_a_pass_s_sampled_distributions_computed_together_are_each_request_s_own():
    """Requests of one sampling setting share a target_probs call; settings that differ in any of
    temperature, top-p or top-k (here only top-p) never do; a greedy request gets none."""
    settings = [SamplingParams(0.8, 0.95), SamplingParams(temperature=0), SamplingParams(0.8, 0.5),
                SamplingParams(0.8, 0.95, seed=3), SamplingParams(1.2, 1.0, top_k=50), SamplingParams(0.8, 0.95)]
    seqs = [SimpleNamespace(request=GenerationRequest(prompt="x", sampling=p)) for p in settings]
    lengths = [1, 3, 2, 4, 1, 5]
    logits = torch.randn(sum(lengths), 4096, generator=torch.Generator().manual_seed(5)) * 3
    probs = sampled_probs(seqs, logits, lengths)
    rows = logits.split(lengths)
    for params, p, own in zip(settings, probs, rows, strict=True):
        if params.greedy:
            assert p is None
        else:
            assert torch.equal(p, target_probs(own, params))


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_mass():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, generator=g) * 2, -1)
    probs[::3] = 0  # a third of the tokens impossible
    probs = probs / probs.sum()
    draws = [int(sample(probs[None], g)) for _ in range(6000)]
    assert all(probs[t] > 0 for t in draws)
    assert fit_pvalue(draws, probs) > 1e-3


def test_the_same_fit_rejects_a_draw_that_is_off_by_one():
    """Negative control: the index after the right one (a classic inverse-CDF slip)."""
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, generator=g) * 2, -1)
    draws = [min(63, int(sample(probs[None], g)) + 1) for _ in range(6000)]
    assert fit_pvalue(draws, probs) < 1e-6


def test_rows_are_drawn_independently_and_unnormalized_rows_are_fine():
    g = torch.Generator().manual_seed(2)
    probs = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.5]])
    for _ in range(50):
        assert sample(probs, g).tolist() == [1, 0, 2]


def test_an_unnormalized_row_is_drawn_by_its_own_mass():
    """The residual of the acceptance rule arrives unnormalized: the draw scales u by the row's total."""
    g = torch.Generator().manual_seed(3)
    weights = torch.tensor([0.75, 0.75, 1.5])  # mass 3, i.e. 1/4, 1/4, 1/2
    draws = [int(sample(weights[None], g)) for _ in range(4000)]
    assert fit_pvalue(draws, weights / weights.sum()) > 1e-3
