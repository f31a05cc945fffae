"""`Kernels.decode_greedy_steps` (through `Transformer.decode_greedy_steps`): several greedy plain decode
steps in one C call, each step's argmax the next step's token, against the same steps run one
`forward_ragged` pass at a time on a twin of the model: bitwise the same picks, routed ids and KV caches,
each step's clock reported; EOS ends the call after the step that picks it; refusals before anything is
written."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels.pool import KernelThreads
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

SLOTS, STARTS = [2, 0, 1], [40, 45, 41]  # three sequences at different positions, slots out of order


def _prefilled(model, slots=3, length=128):
    cache = KVCache(model.cfg, length, slots=slots)
    prompt = torch.randint(1, model.cfg.vocab_size, (46,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for slot in range(slots):
            model.forward(prompt, 0, cache, slot)
    return cache


def _step_by_step(model, cache, tokens: list[int], steps: int):
    """The reference: one forward_ragged pass per step, feeding each step's argmax to the next."""
    picks, routed = [], []
    with torch.inference_mode():
        for step in range(steps):
            batch = RaggedBatch.build(SLOTS, [s + step for s in STARTS], [1] * len(SLOTS))
            out = model.forward_ragged(torch.tensor(tokens), batch, cache)
            tokens = out.argmax.tolist()
            picks.append(tokens)
            routed.append(out.routed_ids)
    return torch.tensor(picks), torch.stack(routed)


def _in_one_call(model, cache, tokens: list[int], steps: int, eos=None):
    batch = RaggedBatch.build(SLOTS, STARTS, [1] * len(SLOTS), tokens=tokens)
    with torch.inference_mode():
        assert model.runs_in_one_call(batch.size)
        return model.decode_greedy_steps(batch, cache, steps, eos)


@pytest.fixture(scope="module")
def twins(k):
    return load_for_inference(DEFAULT_TARGET_DIR, kernels=k), load_for_inference(DEFAULT_TARGET_DIR, kernels=k)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_steps_of_one_call_are_bitwise_the_passes_one_at_a_time(k, twins, threads):
    pool = k.pool(threads) if threads > 1 else None
    try:
        one_call, reference = twins
        one_call.kernel_threads = KernelThreads(pool) if pool else KernelThreads()
        caches = _prefilled(one_call), _prefilled(reference)
        first = [17, 905, 3001]
        picks, routed, seconds = _in_one_call(one_call, caches[0], first, 9)
        expected_picks, expected_routed = _step_by_step(reference, caches[1], first, 9)
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
