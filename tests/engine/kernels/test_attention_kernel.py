"""The attention sub-block of one layer in one C call matches the textbook sub-block, each token of
a ragged pass bitwise alone, split over threads or not; a rejected draft is overwritten; what the
kernel cannot run safely is refused naming the reason."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import library as kernels
from tests.support.kernel_cases import (
    AH,
    AHID,
    AK,
    PASSES,
    SLOTS,
    S,
    attention_reference,
    ragged_pass,
    rope_tables,
    run_attention,
)


@pytest.mark.parametrize("name", list(PASSES))
def test_attention_block_matches_the_textbook_sub_block(ka, attention_weights, name):
    x, positions, slots, k_cache, v_cache = ragged_pass(PASSES[name], seed=len(name), D=attention_weights["D"])
    want, want_k, want_v = attention_reference(x, positions, slots, k_cache, v_cache, attention_weights)
    got = run_attention(ka, attention_weights, x, positions, slots, k_cache, v_cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The cache now holds the pass's keys and values at exactly (slot, position), nothing else moved.
    torch.testing.assert_close(k_cache, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache, want_v, atol=1e-5, rtol=1e-5)


def test_each_token_of_a_ragged_pass_is_bitwise_the_same_alone(ka, attention_weights):
    """Alone, a token sees the cache the pass left (its window's earlier keys included) and must give
    bitwise the pass's row: nothing in a token's result depends on the other tokens of the pass."""
    windows = [(2, 7, 3), (0, 0, 6), (1, 15, 1)]
    x, positions, slots, k_cache, v_cache = ragged_pass(windows, seed=11, D=attention_weights["D"])
    together = run_attention(ka, attention_weights, x, positions, slots, k_cache, v_cache)
    after_k, after_v = k_cache.clone(), v_cache.clone()
    for t in range(x.shape[0]):
        alone = run_attention(ka, attention_weights, x[t:t + 1], positions[t:t + 1], slots[t:t + 1], k_cache, v_cache)
        assert torch.equal(alone[0], together[t]), f"token {t} depends on the rest of the pass"
        assert torch.equal(k_cache, after_k) and torch.equal(v_cache, after_v)  # rewrote the same key/value


@pytest.mark.parametrize("threads", [2, 3, 16])
@pytest.mark.parametrize("kv_only", [False, True], ids=["full", "kv-only"])
def test_a_pass_split_over_threads_is_bitwise_the_one_thread_pass(ka, attention_weights, threads, kv_only):
    """Split, a prefill window's later tokens run on another thread than the keys they attend to: every
    key must be in the cache before any token attends (the kernel joins its threads in between); kv-only
    writes the same keys and values (the query columns skipped whole at head dim 32)."""
    windows = [(2, 7, 3), (0, 0, 12), (1, 15, 1)]
    x, positions, slots, k_cache, v_cache = ragged_pass(windows, seed=17, D=attention_weights["D"])
    one_k, one_v = k_cache.clone(), v_cache.clone()
    one = run_attention(ka, attention_weights, x, positions, slots, one_k, one_v)
    pool = ka.pool(threads)
    split = run_attention(ka, attention_weights, x, positions, slots, k_cache, v_cache, pool, kv_only=kv_only)
    pool.close()
    assert (split is None) == kv_only and (kv_only or torch.equal(split, one))
    assert torch.equal(k_cache, one_k) and torch.equal(v_cache, one_v)


def test_a_rejected_draft_is_overwritten_and_never_read_past_its_position(ka, attention_weights):
    """A 4-token verify window at 10..13 leaves keys at 11..13 (rejected drafts); the next window
    starts at 11 and writes over 11..12: it must give what a cache that never saw the drafts gives."""
    x, positions, slots, k_cache, v_cache = ragged_pass([(1, 10, 4)], seed=12, D=attention_weights["D"])
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    run_attention(ka, attention_weights, x[:1], positions[:1], slots[:1], clean_k, clean_v)  # only 10 accepted
    run_attention(ka, attention_weights, x, positions, slots, k_cache, v_cache)  # the whole verify window
    nxt = torch.randn(2, AHID, generator=torch.Generator().manual_seed(13))
    pos, slot = torch.tensor([11, 12]), torch.tensor([1, 1])
    after_drafts = run_attention(ka, attention_weights, nxt, pos, slot, k_cache, v_cache)
    clean = run_attention(ka, attention_weights, nxt, pos, slot, clean_k, clean_v)
    assert torch.equal(after_drafts, clean)
    assert torch.equal(k_cache[:, 1, :, :13], clean_k[:, 1, :, :13])  # 13 still holds a stale draft: unread


@pytest.mark.parametrize("bad, message", [
    ("position_past_the_cache", r"positions must lie in \[0, 24\)"),
    ("negative_position", "positions must lie"),
    ("slot_past_the_cache", r"cache slots must lie in \[0, 3\)"),
    ("int32_positions", "contiguous int64"),
    ("half_cache", "k_cache must be a contiguous float32"),
])
def test_a_pass_the_kernel_cannot_run_safely_is_refused_with_the_reason(ka, attention_weights, bad, message):
    x, positions, slots, k_cache, v_cache = ragged_pass([(0, 3, 2)], seed=14, D=attention_weights["D"])
    if bad == "position_past_the_cache":
        positions = positions + S - 4
    elif bad == "negative_position":
        positions = positions - 4
    elif bad == "slot_past_the_cache":
        slots = slots + SLOTS
    elif bad == "int32_positions":
        positions = positions.int()
    elif bad == "half_cache":
        k_cache = k_cache.half()
    with pytest.raises(ValueError, match=message):
        run_attention(ka, attention_weights, x, positions, slots, k_cache, v_cache)


def test_attention_weights_that_do_not_fit_are_refused_naming_the_tensor(attention_weights):
    w = dict(attention_weights, o_weight=attention_weights["o_weight"].t())
    with pytest.raises(ValueError, match="o_weight must be"):
        kernels.AttentionWeights(w["norm_weight"], 1e-6, w["qkv_weight"], w["qkv_bias"], w["o_weight"], AH, AK, w["D"])
    with pytest.raises(ValueError, match="whole groups"):
        kernels.AttentionWeights(w["norm_weight"], 1e-6, w["qkv_weight"], w["qkv_bias"], w["o_weight"], 3, AK, w["D"])


def test_every_pass_takes_the_attention_kernel_once_per_layer_unless_fused_attention_is_off(k):
    """Counted on the real kernels (wrapped, still run): a pass within the MoE kernel's window runs
    all its layers in one call (forward_logits, around decoder_layers); a longer one calls the
    attention kernel once per layer (prefill passes take it too); a model fused with
    fused_attention=False calls neither (eager SDPA)."""
    from service.engine.model.ragged import KVCache
    from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

    calls = []

    class Counting(kernels.Kernels):
        def attention_block(self, *args):
            calls.append(args[2])  # the layer
            return super().attention_block(*args)

        def decoder_layers(self, *args, **kwargs):
            calls.append("all layers")
            return super().decoder_layers(*args, **kwargs)

        def forward_logits(self, *args, **kwargs):  # the layer loop, with the embedding and the logits
            calls.append("all layers")
            return super().forward_logits(*args, **kwargs)

    counting = Counting(k.path)
    ids = torch.randint(1, 4000, (32,), generator=torch.Generator().manual_seed(5))
    one_call, per_layer = ["all layers"], list(range(4))
    cases = [(16, True, 16, one_call), (16, True, 32, per_layer), (128, True, 32, one_call), (128, False, 32, [])]
    for limit, fused, n, want in cases:
        model = load_for_inference(DEFAULT_TARGET_DIR, kernels=counting, kernel_window_max=limit,
                                   fused_attention=fused)
        calls.clear()
        with torch.inference_mode():
            model.forward(ids[:n], 0, KVCache(model.cfg, 64))
        assert calls == want, (limit, fused, n)


def test_a_ragged_batch_knows_its_position_and_slot_ranges_and_a_pass_outside_the_cache_is_refused():
    """The ranges a RaggedBatch hands AttentionPass (instead of four reductions) are its tensors'."""
    from service.engine.model.ragged import KVCache, RaggedBatch

    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        B = int(torch.randint(1, 6, (1,), generator=g))
        slots = torch.randperm(8, generator=g)[:B].tolist()
        starts = torch.randint(0, 40, (B,), generator=g).tolist()
        lengths = torch.randint(1, 9, (B,), generator=g).tolist()
        batch = RaggedBatch.build(slots, starts, lengths)
        assert batch.position_range == (int(batch.positions.min()), int(batch.positions.max()))
        assert batch.slot_range == (int(batch.token_slot.min()), int(batch.token_slot.max()))
        assert batch.slots.tolist() == slots
    cache = KVCache(load_target_cfg(), 16, slots=2)
    cos, sin = rope_tables(64, cache.k.shape[-1])
    for slots, starts in (([0], [15]), ([2], [0])):  # position 16 past a 16-long cache; slot 2 of 2
        batch = RaggedBatch.build(slots, starts, [2 if starts[0] else 1])
        with pytest.raises(ValueError, match="must lie in"):
            kernels.AttentionPass(batch.positions, batch.token_slot, cache.k, cache.v, cos, sin,
                                  batch.position_range, batch.slot_range)


def load_target_cfg():
    from service.engine.model.config import ModelConfig
    from service.engine.model.weights import DEFAULT_TARGET_DIR

    return ModelConfig.from_json(DEFAULT_TARGET_DIR / "config.json")
