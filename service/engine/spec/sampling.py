"""Target and draft distributions, sampling, and the lossless speculative acceptance rule.

The rule (Leviathan et al. 2023; Chen et al. 2023): a draft token x ~ q is accepted with
probability min(1, p(x) / q(x)); at the first rejection the target's token is drawn from
norm(max(0, p - q)); if every draft is accepted, one more token is drawn from p. The committed
tokens then follow p exactly for any q, provided q is the distribution the draft really sampled
from (a point mass when the draft is greedy or the n-gram drafter proposes).

Shape legend: k draft positions, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from service.types import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> p [n, V] after temperature, top-k then top-p (HF's order); greedy = point mass."""
    if params.greedy:
        return point_mass(logits.argmax(-1), logits.shape[-1])
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        scaled = scaled.masked_fill(scaled < _kth_largest(scaled, params.top_k), float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        # Keep the smallest set of likeliest tokens whose mass reaches top_p (the top token always
        # stays) and every token tied with its least likely member: equal probabilities are treated
        # alike, as top-k treats ties, so the result never depends on the order of the vocabulary.
        cutoff = _top_p_cutoff(probs, params.top_p)  # [n, 1]
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_p_cutoff(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [n, V] -> [n, 1] the least probability top-p keeps.

    The row is sorted by numpy: torch's CPU sort (and topk) of a model's 4,096 probabilities took
    ~200 us (~75 us for topk(1024)) against numpy's ~10 us, and a sampled request pays this on
    every row it verifies. A sort's values do not depend on the algorithm, and the mass before each
    is summed by torch's cumsum in the same order as before, so the cutoff is exactly the one
    torch's sort gives."""
    ascending = torch.from_numpy(np.sort(probs.detach().float().numpy(), axis=-1))  # [n, V]
    sorted_p = ascending.flip(-1)
    kept = (sorted_p.cumsum(-1) - sorted_p) < top_p  # mass strictly before < top_p
    return sorted_p.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)


def _kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [n, V] -> [n, 1] each row's k-th largest value: numpy's partition, the value torch's topk
    gives (~75 us a row of a model's logits) at a fraction of the cost."""
    v = x.shape[-1]
    return torch.from_numpy(np.partition(x.detach().numpy(), v - k, axis=-1)[:, v - k:v - k + 1])


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [n, V] -> q [n, V]: the distribution the draft samples from (argmax at temperature 0)."""
    if temperature == 0:
        return point_mass(logits.argmax(-1), logits.shape[-1])
    return (logits.float() / temperature).softmax(-1)


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [n] -> [n, V] with probability 1 on each token."""
    return torch.zeros(tokens.shape[0], vocab).scatter_(1, tokens.view(-1, 1), 1.0)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [n, V] (each row a distribution, not necessarily normalized) -> tokens [n]: the
    inverse-CDF draw of one uniform per row (torch.multinomial costs ~10x more on one row of a
    4096-token vocabulary). A token of probability 0 is never drawn: the first index whose
    cumulative mass exceeds u * total has mass of its own."""
    cdf = probs.float().cumsum(-1)  # [n, V]
    u = torch.rand(probs.shape[0], 1, generator=generator) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).view(-1)
    over = tokens >= probs.shape[-1]  # rounding left u * total at the total: the last token with mass
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).float().argmax(-1)
        tokens = torch.where(over, last, tokens)
    return tokens


def accept_greedy(draft: torch.Tensor, target: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """`accept` for a greedy target (p a point mass at target [k+1] argmaxes), whatever q was:
    drafts are accepted while they equal the target's argmax; the next token is the argmax after."""
    k = draft.shape[0]
    ok = draft == target[:k]
    n = int(ok.long().cumprod(0).sum())
    return n, ok, target[n:n + 1]


def accept_greedy_ids(draft: list[int], target: list[int]) -> tuple[int, tuple[bool, ...], int]:
    """`accept_greedy` on plain ids, for the batched step (one argmax over the whole pass, then this
    per request without tensor ops): draft [k], target [k+1] argmaxes -> (n accepted, flags [k], next token)."""
    ok = tuple(d == t for d, t in zip(draft, target, strict=False))
    n = next((i for i, match in enumerate(ok) if not match), len(ok))
    return n, ok, target[n]


def accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
           generator: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Verify k drafts against the target.

    draft [k], q [k, V] (what the draft sampled from), p [k+1, V] (target at each window position).
    Returns (n accepted, accepted flags [k], next token [1]: the residual sample at the first
    rejection, or a sample of p[k] when all k were accepted).
    """
    k = draft.shape[0]
    if k == 0:
        return 0, torch.zeros(0, dtype=torch.bool), sample(p[:1], generator)
    rows = torch.arange(k)
    px, qx = p[rows, draft], q[rows, draft]  # [k]
    u = torch.rand(k, generator=generator)
    ok = u * qx < px  # u < p/q  <=>  accepted with probability min(1, p/q)
    n = int(ok.long().cumprod(0).sum())
    if n == k:
        return n, ok, sample(p[k:k + 1], generator)
    residual = (p[n] - q[n]).clamp(min=0)
    total = residual.sum()
    # p == q leaves no residual mass, but then rejection has probability 0; guard anyway.
    residual = residual / total if total > 0 else p[n]
    return n, ok, sample(residual.unsqueeze(0), generator)
