"""The greedy temperature fit recovers the temperature that generated its labels, and a miscalibrated
guess has a worse likelihood (the fit can fail: a fixed tau of 1 is a negative control)."""

from __future__ import annotations

import pytest
import torch

from service.engine.spec.tree_calibration import fit_greedy_temperature, greedy_nll


@pytest.mark.parametrize("tau", [0.1, 0.3, 1.0, 2.5])
def test_the_fit_recovers_the_temperature_its_labels_were_drawn_at(tau):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 64, generator=gen) * 2
    labels = torch.multinomial((logits / tau).softmax(-1), 1, generator=gen)[:, 0]
    fitted = fit_greedy_temperature(logits, labels)
    assert fitted == pytest.approx(tau, rel=0.1)
    if abs(tau - 1.0) > 0.5:  # the uncalibrated head explains its labels worse
        assert greedy_nll(logits, labels, 1.0) > greedy_nll(logits, labels, fitted) + 0.01


def test_no_positions_leave_the_head_as_it_is():
    assert fit_greedy_temperature(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)) == 1.0


def test_the_batched_continuations_are_each_prompts_own_greedy_output():
    """The fit reads the target's greedy continuations, decoded together in one pass per token: each is
    what `Engine.generate` gives that prompt alone."""
    from service.engine.model.ragged import KVCache
    from service.engine.spec.tree_calibration import calibration_texts, greedy_continuations
    from service.types import DraftPolicy, GenerationRequest, SamplingParams
    from tests.support.engine_helpers import make_engine

    engine = make_engine()
    try:
        prompts = [p[-40:] for p in calibration_texts(engine.tokenizer, engine.max_context)[:3]]
        cache = KVCache(engine.target.cfg, engine.max_context, slots=3)
        with torch.inference_mode():
            texts = greedy_continuations(engine.target, cache, prompts, 12)
        for prompt, text in zip(prompts, texts, strict=True):
            alone = engine.generate(GenerationRequest(prompt_token_ids=tuple(prompt), max_new_tokens=12,
                                                      sampling=SamplingParams(temperature=0)), DraftPolicy())
            assert text == prompt + list(alone.token_ids)
    finally:
        engine.close()
