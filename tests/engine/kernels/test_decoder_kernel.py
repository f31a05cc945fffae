"""`Kernels.decoder_layers`, the whole layer loop of a pass in one C call, against the per-layer
Python loop it replaces (the same kernels called one by one): bitwise the same hidden states,
routed ids, logits and KV caches on the shipped MoE target and dense draft, for a decode step, a
ragged batched verify pass, a prefill (whose last layer only writes keys and values) and a pass
split over two threads; and its refusals."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels.pool import KernelThreads
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_for_inference

# (slots, starts, lengths) after a shared prompt prefix in every slot: one decode token, a batch of
# verify windows of mixed lengths, a 14-token window (the longest the dense MLP's kernel takes is 16).
PASSES = {"decode step": ([0], [40], [1]), "batched verify": ([2, 0, 1], [40, 41, 40], [3, 1, 5]),
          "long window": ([1], [40], [14])}


@pytest.fixture(scope="module", params=[DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["moe target", "dense draft"])
def pair(k, request):
    """The fused model twice: the one-call loop and, on its twin, the per-layer Python loop."""
    one_call = load_for_inference(request.param, kernels=k)
    per_layer = load_for_inference(request.param, kernels=k)
    assert one_call.decoder_stack is not None
    per_layer.decoder_stack = None
    return one_call, per_layer


def _prompt_caches(model, slots: int) -> KVCache:
    cache = KVCache(model.cfg, 128, slots=slots)
    prompt = torch.randint(1, model.cfg.vocab_size, (42,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for slot in range(slots):
            model.forward(prompt, 0, cache, slot)
    return cache


@pytest.mark.parametrize("name", list(PASSES))
def test_one_call_is_bitwise_the_per_layer_loop(pair, name):
    slots, starts, lengths = PASSES[name]
    tokens = torch.randint(1, 4000, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    results = []
    for model in pair:
        cache = _prompt_caches(model, 3)
        with torch.inference_mode():
            out = model.forward_ragged(tokens, RaggedBatch.build(slots, starts, lengths), cache)
        results.append((out, cache))
    (a, cache_a), (b, cache_b) = results
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    if pair[0].cfg.is_moe:
        assert a.routed_ids.shape == (4, sum(lengths), 8) and torch.equal(a.routed_ids, b.routed_ids)
    else:
        assert a.routed_ids is None and b.routed_ids is None
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)


def test_a_prefill_writes_every_layer_cache_bitwise_and_skips_the_last_mlp(pair):
    tokens = torch.randint(1, 4000, (14,), generator=torch.Generator().manual_seed(3))
    batch = RaggedBatch.build([0, 1], [0, 0], [8, 6])
    caches = []
    for model in pair:
        cache = KVCache(model.cfg, 64, slots=2)
        with torch.inference_mode():
            assert model.fill_cache(tokens, batch, cache) is None
            features = model.fill_cache(tokens, batch, cache, features=True)  # the whole last layer too
        caches.append((cache, features))
    (a, fa), (b, fb) = caches
    assert a.k.abs().sum() > 0 and torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(fa, fb)


def test_a_pass_split_over_two_threads_is_bitwise_the_one_thread_pass(k):
    pool = k.pool(2)
    try:
        models = [load_for_inference(DEFAULT_TARGET_DIR, kernels=k, kernel_threads=threads)
                  for threads in (KernelThreads(pool), KernelThreads())]
        slots, starts, lengths = PASSES["batched verify"]
        tokens = torch.randint(1, 4000, (sum(lengths),), generator=torch.Generator().manual_seed(4))
        outs = []
        for model in models:
            cache = _prompt_caches(model, 3)
            with torch.inference_mode():
                outs.append(model.forward_ragged(tokens, RaggedBatch.build(slots, starts, lengths), cache))
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].routed_ids, outs[1].routed_ids)
    finally:
        pool.close()


def test_a_cache_of_another_shape_is_refused_naming_it(pair, k):
    from service.engine.kernels.attention import AttentionPass

    model = pair[0]
    other = KVCache(model.cfg.__class__(**{**model.cfg.__dict__, "num_hidden_layers": 7}), 16)
    batch = RaggedBatch.build([0], [0], [1])
    where = AttentionPass(batch.positions, batch.token_slot, other.k, other.v, model.rope_cos, model.rope_sin)
    with pytest.raises(ValueError, match="the cache holds 7 layers"):
        k.decoder_layers(model.decoder_stack, where, torch.zeros(1, model.cfg.hidden_size), True)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        k.decoder_layers(model.decoder_stack, where, torch.zeros(2, model.cfg.hidden_size), True)
