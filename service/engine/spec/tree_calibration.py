"""How sure the draft head really is: the temperature that makes its probabilities those of the target's
greedy token, fitted once at load, so a draft tree spends its nodes where they are likely accepted.

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


def head_greedy_temperature(target, head, target_cache, texts: list[list[int]]) -> float:
    """The head's greedy tau on token texts (slots 0.. of the target cache are scratch: run before the
    scheduler starts). Its teacher-forced entry p reads the target's feature at p - 1, as its catch-up
    does, and predicts the target's argmax at p. One tau for every depth: fitted on the head's own
    estimates at depths 2..8 (`DraftHead.forward_train`'s unrolled steps) it came out nearly the same on
    the shipped pair, at several times the load time."""
    def logits(tokens: torch.Tensor, out) -> torch.Tensor:
        ((rows, _),) = head.forward_train(target.embed_tokens(tokens)[None], out.features[None], 1)
        return rows[0]

    return _greedy_temperature(target, target_cache, texts, head.vocab, (), logits, shift=0)


def eagle3_greedy_temperature(target, draft, target_cache, texts: list[list[int]]) -> float:
    """An EAGLE-3 draft's greedy tau, as the head's: its teacher-forced entry p (the target's aux layers at
    p, token p + 1) predicts token p + 2, whose greedy choice is the target's argmax at p + 1."""
    def logits(tokens: torch.Tensor, out) -> torch.Tensor:
        ((rows, _),) = draft.forward_train(target.embed_tokens(tokens[1:])[None], out.aux[None, :-1], 1)
        return rows[0]

    return _greedy_temperature(target, target_cache, texts, draft.target_ids, draft.cfg.aux_layer_ids, logits,
                               shift=1)


def _greedy_temperature(target, target_cache, texts: list[list[int]], vocab: torch.Tensor, capture: tuple[int, ...],
                        draft_logits, shift: int) -> float:
    """The fit on the target's greedy continuations of texts: one target pass per text (capturing the
    layers a draft reads), then the draft's teacher-forced logits over it (`draft_logits(tokens, out)`
    -> [n - shift, Vd], row p predicting the target's argmax at p + shift), labelled where that argmax
    lies in the draft vocabulary `vocab` (target ids [Vd]) and past the prompt."""
    from service.engine.model.ragged import RaggedBatch

    index = {int(t): i for i, t in enumerate(vocab.tolist())}
    rows, labels = [], []
    with torch.inference_mode():
        # What a greedy request drafts along: the target's own greedy continuation of the prompt (on the
        # prompt's human-written text the target's argmax is much harder to guess than on its own output).
        for prompt, ids in zip(texts, greedy_continuations(target, target_cache, texts, CONTINUATION), strict=False):
            tokens = torch.tensor(ids)
            out = target.forward_ragged(tokens, RaggedBatch.build([0], [0], [len(ids)]), target_cache, capture=capture)
            argmax = out.logits.argmax(-1).tolist()
            keep = [p for p in range(len(ids) - shift)
                    if argmax[p + shift] in index and p + shift >= len(prompt) - 1]
            rows.append(draft_logits(tokens, out)[keep])
            labels.append(torch.tensor([index[argmax[p + shift]] for p in keep], dtype=torch.long))
    return fit_greedy_temperature(torch.cat(rows), torch.cat(labels))


def greedy_continuations(target, cache, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt (as many as the cache has slots, each cut to leave room) + the target's next n greedy
    tokens, decoded together: one prefill pass, then one pass of one token per prompt per step."""
    from service.engine.model.ragged import RaggedBatch

    texts = [list(p[:cache.max_len - n]) for p in prompts[:cache.slots]]
    slots, lengths = list(range(len(texts))), [len(t) for t in texts]
    batch = RaggedBatch.build(slots, [0] * len(texts), lengths)
    last = torch.tensor(lengths).cumsum(0) - 1
    logits = target.forward_ragged(torch.tensor([t for text in texts for t in text]), batch, cache, last).logits
    for step in range(n):
        for text, token in zip(texts, logits.argmax(-1).tolist(), strict=True):
            text.append(token)
        if step < n - 1:
            batch = RaggedBatch.build(slots, [len(t) - 1 for t in texts], [1] * len(texts))
            logits = target.forward_ragged(torch.tensor([t[-1] for t in texts]), batch, cache).logits
    return texts


def calibration_texts(tokenizer, max_len: int) -> list[list[int]]:
    """The calibration prompts as token ids, each cut to `max_len`."""
    lines = CALIBRATION_PROMPTS.read_text().splitlines()
    return [tokenizer.encode(json.loads(lines[i])["prompt"]).ids[:max_len] for i in CALIBRATION_IDS]
