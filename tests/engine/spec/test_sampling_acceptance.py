"""The acceptance rule, window by window: every committed position follows the target's p (the
bonus token included), and no token outside p's support is ever committed. Each statistical check
is also run against deliberately wrong rules (tests/support/engine_helpers.py), which it must reject.

Synthetic windows: p [k+1, V] and q [k, V] do not depend on earlier tokens, so the token committed
at window position i, given the window got that far, must follow p[i] exactly.
"""

from __future__ import annotations

import pytest
import torch

from service.engine.spec.sampling import accept, sample, target_probs
from service.types import SamplingParams
from tests.support.engine_helpers import (
    accept_bonus_from_q,
    accept_residual_from_abs_difference,
    accept_residual_from_p,
    accept_told_q_at_temperature,
    fit_pvalue,
)

V, K, WINDOWS = 40, 3, 4000
DRAFT_TEMPERATURE = 1.5


def run_windows(rule, p: torch.Tensor, q: torch.Tensor, windows: int = WINDOWS, seed: int = 0):
    """Draw drafts from q, run `rule`; -> (committed token lists, accepted counts)."""
    gen = torch.Generator().manual_seed(seed)
    committed, accepted = [], []
    for _ in range(windows):
        drafts = sample(q, gen)  # [k], one per row of q
        n, _, nxt = rule(drafts, q, p, gen)
        committed.append(drafts[:n].tolist() + nxt.tolist())
        accepted.append(n)
    return committed, accepted


def position_pvalues(committed: list[list[int]], p: torch.Tensor) -> list[float]:
    """Fit of the tokens committed at each window position to that position's p."""
    return [fit_pvalue([c[i] for c in committed if len(c) > i], p[i]) for i in range(p.shape[0])]


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    """Seeded logits for the k+1 target positions, spread enough for a fit test to have bins."""
    return torch.randn(K + 1, V, generator=torch.Generator().manual_seed(3)) * 1.5


@pytest.fixture(scope="module")
def p(logits) -> torch.Tensor:
    probs = target_probs(logits, SamplingParams(temperature=1.0))
    # Power: every position has several tokens expected 50+ times in WINDOWS draws, none dominates.
    assert (probs > 50 / WINDOWS).sum(-1).min() >= 6 and probs.max() < 0.5, "p too peaked for a fit test"
    return probs


def test_bonus_token_follows_p_when_the_draft_is_the_target(p):
    """q = p: every draft is accepted with probability 1, so every window ends with a bonus draw."""
    q = p[:K]
    committed, accepted = run_windows(accept, p, q)
    assert set(accepted) == {K}
    assert fit_pvalue([c[K] for c in committed], p[K]) > 1e-3
    # Negative control: the bonus drawn from the draft's last q (here p[K-1]) is rejected.
    wrong, _ = run_windows(accept_bonus_from_q, p, q)
    assert fit_pvalue([c[K] for c in wrong], p[K]) < 1e-6


WRONG_RULES = {
    "q without the draft temperature": accept_told_q_at_temperature(1.0, DRAFT_TEMPERATURE),
    "bonus from q": accept_bonus_from_q,
    "residual from p": accept_residual_from_p,
}


def test_every_window_position_follows_p_for_a_sampled_draft(logits, p):
    """q = the same logits at another temperature: drafts are often, not always, accepted."""
    q = (logits[:K] / DRAFT_TEMPERATURE).softmax(-1)
    committed, accepted = run_windows(accept, p, q)
    full = sum(n == K for n in accepted) / len(accepted)
    rejected_first = sum(n == 0 for n in accepted) / len(accepted)
    assert full > 0.2 and rejected_first > 0.1, (full, rejected_first)  # both paths well exercised
    assert min(position_pvalues(committed, p)) > 1e-3 / (K + 1)
    for name, rule in WRONG_RULES.items():
        wrong, _ = run_windows(rule, p, q)
        assert min(position_pvalues(wrong, p)) < 1e-6, f"the test cannot tell the rule with {name}"


@pytest.mark.parametrize("params", [SamplingParams(top_k=4), SamplingParams(top_p=0.6),
                                    SamplingParams(temperature=0.7, top_k=6, top_p=0.8)], ids=str)
def test_no_token_outside_the_top_k_top_p_support_is_ever_committed(logits, params):
    """Direct check (a pooled fit test cannot see a rare out-of-support token), for drafts that
    mostly propose tokens outside the support: a flat q, a hot q, and a point mass outside it."""
    p = target_probs(logits, params)
    support = p > 0
    outside = int((~support[0]).nonzero()[0])
    flat = torch.full((K, V), 1.0 / V)
    hot = (logits[:K] / 3.0).softmax(-1)
    fixed = torch.zeros(K, V)
    fixed[:, outside] = 1.0
    for q in (flat, hot, fixed):
        committed, _ = run_windows(accept, p, q, windows=1500)
        assert all(support[i, t] for c in committed for i, t in enumerate(c))
    # Negative control: a residual drawn from |p - q| instead of max(0, p - q) leaks outside.
    wrong, _ = run_windows(accept_residual_from_abs_difference, p, flat, windows=1500)
    assert not all(support[i, t] for c in wrong for i, t in enumerate(c))
