"""Target and draft distributions, sampling, and the lossless speculative acceptance rule.

The rule (Leviathan et al. 2023; Chen et al. 2023): a draft token x ~ q is accepted with
probability min(1, p(x) / q(x)); at the first rejection the target's token is drawn from
norm(max(0, p - q)); if every draft is accepted, one more token is drawn from p. The committed
tokens then follow p exactly for any q, provided q is the distribution the draft really sampled
from (a point mass when the draft is greedy or the n-gram drafter proposes).

Shape legend: k draft positions, V vocabulary.
"""

from __future__ import annotations

import torch

from service.types import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> p [n, V] after temperature, top-k then top-p (HF's order); greedy = point mass."""
    if params.greedy:
        return point_mass(logits.argmax(-1), logits.shape[-1])
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        # Keep the smallest set of likeliest tokens whose mass reaches top_p (the top token always
        # stays) and every token tied with its least likely member: equal probabilities are treated
        # alike, as top-k treats ties, so the result never depends on the order of the vocabulary.
        cutoff = _top_p_cutoff(probs, params.top_p)  # [n, 1]
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


TOP_P_PREFIX = 1024  # likeliest tokens sorted first; the whole vocabulary only when their mass falls short


def _top_p_cutoff(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [n, V] -> [n, 1] the least probability top-p keeps. The kept set is usually a few
    tokens: the sorted prefix of the likeliest TOP_P_PREFIX (topk's values are the full sort's first
    values, summed in the same order, so the cutoff is the one a full sort gives) decides it when
    the set ends inside the prefix; otherwise the whole vocabulary is sorted."""
    prefix = min(TOP_P_PREFIX, probs.shape[-1])
    for sorted_p in (probs.topk(prefix, -1).values, None):
        if sorted_p is None:
            sorted_p = probs.sort(-1, descending=True).values  # [n, V]
        kept = (sorted_p.cumsum(-1) - sorted_p) < top_p  # mass strictly before < top_p
        if sorted_p.shape[-1] == probs.shape[-1] or not bool(kept[:, -1].any()):
            return sorted_p.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
    raise AssertionError("unreachable")


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
