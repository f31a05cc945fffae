"""`Kernels.decode_steps` (through `Transformer.decode_steps`): several plain decode steps in one C
call, each step's picks the next step's tokens, against the same steps run one `forward_ragged` pass at
a time on a twin of the model: bitwise the same picks, routed ids and KV caches, each step's clock
reported. Greedy rows pick the argmax; sampled rows (`StepSampling`) the token `Kernels.sample_rows`
draws from the twin's logits with the same uniform. EOS ends the call after the step that picks it;
refusals before anything is written."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels.forward import StepSampling
from service.engine.kernels.pool import KernelThreads
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference
from service.types import SamplingParams

SLOTS, STARTS = [2, 0, 1], [40, 45, 41]  # three sequences at different positions, slots out of order


def _prefilled(model, slots=3, length=128):
    cache = KVCache(model.cfg, length, slots=slots)
    prompt = torch.randint(1, model.cfg.vocab_size, (46,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for slot in range(slots):
            model.forward(prompt, 0, cache, slot)
    return cache


# Row 0 greedy, rows 1 and 2 sampled with different settings.
SETTINGS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95),
            SamplingParams(temperature=1.2, top_k=40)]


def _uniforms(steps: int) -> torch.Tensor:
    return torch.rand(steps, len(SLOTS), generator=torch.Generator().manual_seed(5))


def _step_by_step(model, cache, tokens: list[int], steps: int, sampled: bool = False):
    """The reference: one forward_ragged pass per step, feeding each step's picks to the next (a
    sampled row's drawn by `sample_rows` from the pass's logits with the same uniform)."""
    picks, routed, uniforms = [], [], _uniforms(steps)
    with torch.inference_mode():
        for step in range(steps):
            batch = RaggedBatch.build(SLOTS, [s + step for s in STARTS], [1] * len(SLOTS))
            out = model.forward_ragged(torch.tensor(tokens), batch, cache)
            tokens = out.argmax.tolist()
            for b, params in enumerate(SETTINGS if sampled else ()):
                if not params.greedy:
                    tokens[b] = int(model.kernels.sample_rows(out.logits[b:b + 1].contiguous(), params,
                                                              uniforms[step, b:b + 1].contiguous())[0])
            picks.append(tokens)
            routed.append(out.routed_ids)
    return torch.tensor(picks), torch.stack(routed)


def _sampling(steps: int) -> StepSampling:
    return StepSampling.of(torch.tensor([p.temperature for p in SETTINGS], dtype=torch.float32),
                           torch.tensor([p.top_k for p in SETTINGS]),
                           torch.tensor([p.top_p for p in SETTINGS], dtype=torch.float32), _uniforms(steps))


def _in_one_call(model, cache, tokens: list[int], steps: int, eos=None, sampled: bool = False):
    batch = RaggedBatch.build(SLOTS, STARTS, [1] * len(SLOTS), tokens=tokens)
    with torch.inference_mode():
        assert model.runs_in_one_call(batch.size)
        return model.decode_steps(batch, cache, steps, eos, _sampling(steps) if sampled else None)


@pytest.fixture(scope="module")
def twins(k):
    return load_for_inference(DEFAULT_TARGET_DIR, kernels=k), load_for_inference(DEFAULT_TARGET_DIR, kernels=k)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_steps_of_one_call_are_bitwise_the_passes_one_at_a_time(k, twins, threads, sampled):
    pool = k.pool(threads) if threads > 1 else None
    try:
        one_call, reference = twins
        one_call.kernel_threads = KernelThreads(pool) if pool else KernelThreads()
        caches = _prefilled(one_call), _prefilled(reference)
        first = [17, 905, 3001]
        picks, routed, seconds = _in_one_call(one_call, caches[0], first, 9, sampled=sampled)
        expected_picks, expected_routed = _step_by_step(reference, caches[1], first, 9, sampled)
        assert torch.equal(picks, expected_picks) and torch.equal(routed, expected_routed)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        assert len(seconds) == 9 and all(0 < s < 1 for s in seconds)
        assert picks.shape == (9, 3) and routed.shape == (9, one_call.cfg.num_hidden_layers, 3, 8)
    finally:
        twins[0].kernel_threads = KernelThreads()
        if pool:
            pool.close()


def test_the_call_ends_after_the_step_that_picks_eos(twins):
    model = twins[0]
    first = [17, 905, 3001]
    picks, _, _ = _in_one_call(model, _prefilled(model), first, 9)
    eos = picks[3, 1].item()  # sequence 1's fourth pick, taken for EOS
    expected = next(step for step in range(9) if eos in picks[step].tolist()) + 1  # (an earlier step may hold it)
    cut, routed, seconds = _in_one_call(model, _prefilled(model), first, 9, eos=eos)
    assert cut.shape[0] == routed.shape[0] == len(seconds) == expected <= 4
    assert torch.equal(cut, picks[:expected])


def test_bad_tokens_and_positions_past_the_cache_are_refused_before_anything_is_written(twins):
    model = twins[0]
    cache = KVCache(model.cfg, 48, slots=3)
    with pytest.raises(IndexError, match="token id lies outside"):
        _in_one_call(model, cache, [1, model.cfg.vocab_size, 2], 2)
    # The last step would write position 45 + 3 = 48, one past a 48-position cache.
    with pytest.raises(ValueError, match="positions must lie in"):
        _in_one_call(model, cache, [1, 2, 3], 4)
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0
    _in_one_call(model, cache, [1, 2, 3], 3)  # (the last position that fits)


def test_sampling_for_other_rows_or_fewer_steps_is_refused(twins):
    model = twins[0]
    cache = _prefilled(model)
    with pytest.raises(ValueError, match="sampling is for 3 rows and 2 steps"):
        batch = RaggedBatch.build(SLOTS, STARTS, [1] * len(SLOTS), tokens=[1, 2, 3])
        with torch.inference_mode():
            model.decode_steps(batch, cache, 4, None, _sampling(2))
