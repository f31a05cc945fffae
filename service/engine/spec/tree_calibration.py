"""How sure the draft head really is: per drafting depth, the temperature that makes its probabilities
those of the target's greedy token, fitted once at load, so a draft tree spends its nodes where they are
likely accepted.

Why: a top-candidate tree keeps the nodes of highest path probability (tree_drafting.py), which is the
tree of most expected accepted drafts only if a candidate's probability is its chance of acceptance.
For a greedy request that chance is P(target's argmax = candidate). The shipped head's argmax agrees
with the target's ~95% of the time on held-out code, yet its softmax gives that argmax much less mass:
ranked by raw probabilities, a tree spends nodes on siblings a greedy target never takes, and accepts
less per pass than a chain of the same size. Temperature scaling (one scalar tau, logits / tau) fitted
by the likelihood of the target's argmax is the standard fix; a sampled request at temperature T needs
no fit: the head was trained to match the target's distribution, and its softmax at T is what a
top candidate's acceptance, p_T(candidate), is estimated by.

Shape legend: n positions, Vd draft vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# What the fit reads: the last 8 of the held-out prompts (benchmarks and the demo's load start from the
# first ones).
CALIBRATION_PROMPTS = Path(__file__).resolve().parents[2] / "prompts" / "heldout.jsonl"
CALIBRATION_IDS = range(56, 64)
CONTINUATION = 48  # greedy tokens generated after each prompt: the positions the fit reads
TAU_RANGE = (0.02, 4.0)  # the search's bounds (a tau at a bound says the head is badly off; it is kept)


def greedy_nll(logits: torch.Tensor, target: torch.Tensor, tau: float) -> float:
    """Mean negative log-likelihood of the target's argmax (draft indices [n]) under softmax(logits / tau)."""
    return float(-torch.log_softmax(logits / tau, dim=-1).gather(1, target[:, None]).mean())


def fit_greedy_temperature(logits: torch.Tensor, target: torch.Tensor, steps: int = 40) -> float:
    """logits [n, Vd] the head's at n positions, target [n] the draft index of the target's argmax at each
    (positions whose argmax lies outside the draft vocabulary dropped by the caller) -> the tau that
    minimises `greedy_nll` (golden-section search over log tau: the NLL of a temperature is unimodal)."""
    if logits.shape[0] == 0:
        return 1.0
    logits = logits.float()
    low, high = math.log(TAU_RANGE[0]), math.log(TAU_RANGE[1])
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = greedy_nll(logits, target, math.exp(a)), greedy_nll(logits, target, math.exp(b))
    for _ in range(steps):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = greedy_nll(logits, target, math.exp(a))
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = greedy_nll(logits, target, math.exp(b))
    return math.exp((low + high) / 2)


def head_greedy_temperatures(target, head, target_cache, texts: list[list[int]], depths: int) -> tuple[float, ...]:
    """The head's greedy tau at each drafting depth 1..depths, on token texts (each fits the target cache,
    whose slot 0 is scratch: run before the scheduler starts). A text's target pass gives its features and
    argmaxes; the head's unrolled pass (`DraftHead.forward_train`: step s is what drafting the s-th token
    of a chain sees, its own feature estimates for the s - 1 before) gives depth s's logits. A depth is
    fitted on its own: the head is less sure on its own estimates, and a deep node's acceptance is what
    decides whether a tree goes deeper or wider."""
    from service.engine.model.ragged import RaggedBatch

    index = {int(t): i for i, t in enumerate(head.vocab.tolist())}
    per_depth: list[list[torch.Tensor]] = [[] for _ in range(depths)]
    labels: list[torch.Tensor] = []
    with torch.inference_mode():
        for prompt in texts:
            # What a greedy request drafts along: the target's own greedy continuation of the prompt (on the
            # prompt's human-written text the target's argmax is much harder to guess than on its own output).
            ids = greedy_continuation(target, target_cache, prompt, CONTINUATION)
            tokens = torch.tensor(ids)
            out = target.forward_ragged(tokens, RaggedBatch.build([0], [0], [len(ids)]), target_cache)
            argmax = out.logits.argmax(-1).tolist()
            keep = torch.tensor([p for p, t in enumerate(argmax) if t in index and p >= len(prompt) - 1],
                                dtype=torch.long)
            labels.append(torch.tensor([index[argmax[p]] for p in keep.tolist()], dtype=torch.long))
            unrolled = head.forward_train(target.embed_tokens(tokens)[None], out.features[None], depths)
            for d, (logits, _) in enumerate(unrolled):
                per_depth[d].append(logits[0, keep])
    target_ids = torch.cat(labels)
    # (entries p < s - 1 have no s-th draft in a chain; their rows are kept: a few per text)
    return tuple(fit_greedy_temperature(torch.cat(rows), target_ids) for rows in per_depth)


def greedy_continuation(target, cache, prompt: list[int], n: int) -> list[int]:
    """prompt + the target's next n greedy tokens (cut to the cache's length), decoded in slot 0."""
    ids = list(prompt[:cache.max_len - n])
    logits = target.forward(torch.tensor(ids), 0, cache).logits[-1]
    for _ in range(n):
        ids.append(int(logits.argmax()))
        logits = target.forward(torch.tensor(ids[-1:]), len(ids) - 1, cache).logits[-1]
    return ids


def calibration_texts(tokenizer, max_len: int) -> list[list[int]]:
    """The calibration prompts as token ids, each cut to `max_len`."""
    lines = CALIBRATION_PROMPTS.read_text().splitlines()
    return [tokenizer.encode(json.loads(lines[i])["prompt"]).ids[:max_len] for i in CALIBRATION_IDS]
