"""`Kernels.forward_logits`, a short pass from token ids to logits in one C call, against the separate
calls it replaces (the embedding, the layer loop, the final norm and the output layer, each its own
call, on a twin of the same model): bitwise the same logits, features, routed ids and KV caches on the
shipped MoE target and dense draft, with and without logit rows and split over two threads; its
argmax is numpy's; and its refusals."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels.attention import AttentionPass
from service.engine.kernels.pool import KernelThreads
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_for_inference

# (slots, starts, lengths): a decode step, a batched verify pass of mixed windows, a 14-token window.
PASSES = {"decode step": ([0], [40], [1]), "batched verify": ([2, 0, 1], [40, 41, 40], [3, 1, 5]),
          "long window": ([1], [40], [14])}


def _twins(model_dir, k, threads=None):
    """The model twice: one pass in one call, and (its twin) the separate calls."""
    kw = {} if threads is None else {"kernel_threads": threads}
    one_call, parts = load_for_inference(model_dir, kernels=k, **kw), load_for_inference(model_dir, kernels=k, **kw)
    assert one_call.output_head is not None
    parts.output_head = None
    return one_call, parts


@pytest.fixture(scope="module", params=[DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["moe target", "dense draft"])
def twins(k, request):
    return _twins(request.param, k)


def _run(model, tokens, slots, starts, lengths, rows=None):
    cache = KVCache(model.cfg, 128, slots=3)
    prompt = torch.randint(1, model.cfg.vocab_size, (42,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for slot in range(3):
            model.forward(prompt, 0, cache, slot)
        out = model.forward_ragged(tokens, RaggedBatch.build(slots, starts, lengths), cache, logit_rows=rows)
    return out, cache


def _assert_same(a, b, moe: bool):
    (out_a, cache_a), (out_b, cache_b) = a, b
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.features, out_b.features)
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)
    if moe:
        assert torch.equal(out_a.routed_ids, out_b.routed_ids)
    else:
        assert out_a.routed_ids is None and out_b.routed_ids is None
    # The one call's argmax is the first maximum of each row, as numpy's (what acceptance read before).
    assert torch.equal(out_a.argmax, torch.from_numpy(out_b.logits.numpy().argmax(-1)))
    assert out_b.argmax is None


@pytest.mark.parametrize("name", list(PASSES))
def test_one_call_is_bitwise_the_separate_calls(twins, name):
    slots, starts, lengths = PASSES[name]
    tokens = torch.randint(1, 4000, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    _assert_same(*(_run(m, tokens, slots, starts, lengths) for m in twins), twins[0].cfg.is_moe)


def test_logit_rows_pick_the_same_rows(twins):
    slots, starts, lengths = PASSES["batched verify"]
    tokens = torch.randint(1, 4000, (sum(lengths),), generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([8, 0, 3])  # out of order: each window's last token, as a dense draft asks
    results = [_run(m, tokens, slots, starts, lengths, rows) for m in twins]
    _assert_same(*results, twins[0].cfg.is_moe)
    assert results[0][0].logits.shape == (3, twins[0].cfg.vocab_size)


def test_a_pass_over_two_threads_is_bitwise_the_one_thread_pass(k):
    pool = k.pool(2)
    try:
        split = _twins(DEFAULT_TARGET_DIR, k, KernelThreads(pool))[0]
        alone = _twins(DEFAULT_TARGET_DIR, k)[1]
        for name in ("decode step", "batched verify"):  # attention by columns, then by tokens
            slots, starts, lengths = PASSES[name]
            tokens = torch.randint(1, 4000, (sum(lengths),), generator=torch.Generator().manual_seed(4))
            _assert_same(_run(split, tokens, slots, starts, lengths), _run(alone, tokens, slots, starts, lengths),
                         moe=True)
    finally:
        pool.close()


def test_token_ids_and_rows_outside_the_pass_are_refused_before_anything_is_written(twins, k):
    model = twins[0]
    cache = KVCache(model.cfg, 16)
    batch = RaggedBatch.build([0], [0], [2])
    where = AttentionPass(batch.positions, batch.token_slot, cache.k, cache.v, model.rope_cos, model.rope_sin)
    with pytest.raises(IndexError, match="token id lies outside"):
        k.forward_logits(model.decoder_stack, model.output_head, where, torch.tensor([1, model.cfg.vocab_size]))
    with pytest.raises(IndexError, match="logit row lies outside"):
        k.forward_logits(model.decoder_stack, model.output_head, where, torch.tensor([1, 2]), torch.tensor([2]))
    assert cache.k.abs().sum() == 0  # nothing was written
    with pytest.raises(ValueError, match="tokens must be a contiguous int64"):
        k.forward_logits(model.decoder_stack, model.output_head, where, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("case", ["ties", "nan"])
def test_the_argmax_is_numpys_first_maximum_on_ties_and_nan(k, case):
    """An output layer of zeros ties every logit (the first index wins); a NaN row wins over any number,
    as in numpy's argmax, which acceptance read before."""
    from service.engine.kernels.forward import OutputHead
    from service.engine.kernels.packed import PackedWeight

    model = load_for_inference(DEFAULT_TARGET_DIR, kernels=k)
    V, H = model.cfg.vocab_size, model.cfg.hidden_size
    weight = torch.zeros(V, H)
    if case == "nan":
        weight[7] = float("nan")
    head = OutputHead.of(model.embed_tokens.weight.detach(), model.norm.weight.detach(), model.norm.eps,
                         PackedWeight.pack(weight))
    cache = KVCache(model.cfg, 16)
    batch = RaggedBatch.build([0], [0], [2])
    where = AttentionPass(batch.positions, batch.token_slot, cache.k, cache.v, model.rope_cos, model.rope_sin)
    with torch.inference_mode():
        _, logits, _, argmax = k.forward_logits(model.decoder_stack, head, where, torch.tensor([3, 4]))
    assert argmax.tolist() == ([0, 0] if case == "ties" else [7, 7])
    assert torch.equal(argmax, torch.from_numpy(logits.numpy().argmax(-1)))
