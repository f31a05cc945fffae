"""A ranking temperature for SGLang's EAGLE draft trees (speculative_eagle_topk > 1).

SGLang grows an EAGLE tree from the draft's probabilities: every step expands the candidates of best
path score (the product of the draft's probabilities along the path) and the verify window takes the
best of all. Those probabilities come from one function, `speculative/spec_utils.py:renorm_draft_probs`
(a plain softmax of the draft's logits, except under rejection sampling). A draft whose softmax is
flatter than its argmax is right (the shipped ones: see docs/engine.md, "Ranked by what is accepted")
spends the tree's nodes on siblings a greedy target never takes. This AROUND hook divides the logits
by a temperature tau before that softmax, so the tree is ranked by calibrated probabilities.

Why it is lossless: the probabilities decide only which candidates are drafted. A greedy verify takes
the target's argmax whatever was drafted, and SGLang's sampled tree verify reads the target's
probabilities only (tree_speculative_sampling_target_only). Under rejection sampling (the draft's
probabilities enter the verify) the hook passes the call through untouched.
"""

from __future__ import annotations


def ranked_draft_probs(tau: float):
    """The AROUND hook of renorm_draft_probs(next_token_logits, sampling_info, use_rejection_sampling)."""

    def renorm_draft_probs(original, next_token_logits, sampling_info, use_rejection_sampling, *args, **kwargs):
        if use_rejection_sampling:
            return original(next_token_logits, sampling_info, use_rejection_sampling, *args, **kwargs)
        return original(next_token_logits / tau, sampling_info, use_rejection_sampling, *args, **kwargs)

    return renorm_draft_probs
