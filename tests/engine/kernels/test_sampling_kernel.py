"""The C sampler (csrc/sampling.c) against the torch path it replaces: spec/sampling.py's `target_probs`
(itself checked against transformers' warpers in tests/engine/spec/test_sampling_oracle.py), then
`sample`'s inverse-CDF draw (`Kernels.sample_rows`, plain sampled steps) or `accept`'s verdict on a
chain of drafts (`Kernels.accept_drafts`).

For each row and setting, a grid of uniforms: each must pick the token the torch path's cumulative
distribution gives that uniform, except where the uniform lies within float rounding of a boundary
between two tokens (the two compute exp and the sums apart). Rows are chosen to make the settings
bite: spread and peaked logits, ties at the top-k and top-p boundaries, a logit row of one value. Both
run on this CPU's build, AVX-512 without BF16 and portable C (the scalar paths of every pass).
Verdicts: for drafts drawn from q and from p, with the same uniforms, the same drafts accepted, the same
tests and the same next token as `accept` in every case (a case at a rounding boundary has a chance of
~1e-6 in these draws)."""

from __future__ import annotations

import pytest
import torch

from service.engine.spec.sampling import accept, target_probs
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
def test_each_uniform_picks_the_torch_paths_token(kb, params):
    for row in _rows():
        want, gap = _torch_tokens(row, params, GRID)
        got = kb.sample_rows(row[None].expand(len(GRID), -1).contiguous(), params, GRID.contiguous())
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


@pytest.mark.parametrize("params", SETTINGS[:5], ids=str)
def test_chain_verdicts_are_accepts_with_the_same_uniforms(kb, params):
    g = torch.Generator().manual_seed(11)
    for drafts_k in (1, 3, 6):
        logits = torch.randn(drafts_k + 1, V, generator=g) * 3
        q = (torch.randn(drafts_k, V, generator=g) * 3).softmax(-1)  # a draft near enough to be accepted at times
        p = target_probs(logits, params)
        outcomes = set()
        for trial in range(60):
            source = q if trial % 2 else p[:drafts_k]  # drafts from q, and from p (accepted more often)
            drafts = torch.multinomial(source, 1, generator=g).view(-1)
            state = g.get_state()
            want_n, want_ok, want_token = accept(drafts, q, p, g)
            g.set_state(state)
            uniforms = torch.cat([torch.rand(drafts_k, generator=g), torch.rand(1, generator=g)])
            n, ok, token = kb.accept_drafts(logits, params, drafts, q, uniforms)
            assert (n, ok.tolist(), token) == (want_n, want_ok.tolist(), int(want_token)), (params, drafts_k, trial)
            outcomes.add(n)
        assert len(outcomes) > 1  # (both accepted and rejected drafts were seen)


def test_bad_input_is_refused(k):
    with pytest.raises(ValueError, match="greedy"):
        k.sample_rows(torch.zeros(1, V), SamplingParams(temperature=0), torch.zeros(1))
    with pytest.raises(ValueError, match="uniforms"):
        k.sample_rows(torch.zeros(2, V), SamplingParams(), torch.zeros(3))
    with pytest.raises(ValueError, match="logits"):
        k.sample_rows(torch.zeros(2, V, dtype=torch.float64), SamplingParams(), torch.zeros(2))
    drafts, q = torch.tensor([3, 4]), torch.full((2, V), 1.0 / V)
    with pytest.raises(ValueError, match="drafts"):
        k.accept_drafts(torch.zeros(3, V), SamplingParams(), torch.tensor([3, V]), q, torch.zeros(3))
    with pytest.raises(ValueError, match="q must be"):
        k.accept_drafts(torch.zeros(3, V), SamplingParams(), drafts, q[:1], torch.zeros(3))
    with pytest.raises(ValueError, match="logits"):
        k.accept_drafts(torch.zeros(2, V), SamplingParams(), drafts, q, torch.zeros(3))
