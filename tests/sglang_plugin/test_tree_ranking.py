"""The plugin's tree ranking (service/sglang_plugin/tree_ranking.py) around a stand-in for SGLang's
renorm_draft_probs: a draft tree's candidates are ranked by softmax(logits / tau); a draft whose
probabilities enter a rejection-sampling verify is left as SGLang makes it."""

from __future__ import annotations

import torch

from service.sglang_plugin.tree_ranking import ranked_draft_probs


def plain_softmax(next_token_logits, sampling_info, use_rejection_sampling):
    """What SGLang 0.5.23's renorm_draft_probs does without rejection sampling (and a marker with it)."""
    if use_rejection_sampling:
        return ("untouched", next_token_logits)
    return torch.softmax(next_token_logits, dim=-1)


def test_the_candidates_are_ranked_at_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.9, 1.0]])
    hook = ranked_draft_probs(0.25)
    got = hook(plain_softmax, logits, None, False)
    torch.testing.assert_close(got, torch.softmax(logits / 0.25, dim=-1))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))  # the same best candidate, sharper odds
    assert got.max() > torch.softmax(logits, dim=-1).max()


def test_a_rejection_sampling_draft_is_passed_through():
    logits = torch.tensor([[2.0, 1.0]])
    marker, passed = ranked_draft_probs(0.25)(plain_softmax, logits, None, True)
    assert marker == "untouched" and passed is logits
