"""The fused C kernels compute what a per-position PyTorch reference computes, each position
independently of the rest of its window (so a verify pass and a plain step agree bitwise), and
refuse tensors they would read out of bounds. Model-level parity with transformers is in
test_model_parity.py (the "fast" loader)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.kernels import library as kernels
from service.engine.kernels.packed import BF16_MATH, PackedWeight
from tests.support.kernel_cases import (
    AD,
    AH,
    AHID,
    AK,
    E,
    H,
    M,
    S,
    bf16_values,
    block_reference,
    ragged_pass,
    reference,
    rope_tables,
    run,
    window,
)


@pytest.mark.parametrize("w", [1, 3, 16, 70])  # 70: ~21 positions an expert, past one 16-row chunk
def test_fused_experts_match_a_per_position_reference(k, experts, w):
    x, ids, weights = window(w, seed=w)
    torch.testing.assert_close(run(k, x, ids, weights, *experts), reference(x, ids, weights, *experts),
                               atol=1e-5, rtol=1e-5)


def test_each_position_is_bitwise_the_same_alone_or_in_a_window(k, experts):
    x, ids, weights = window(70, seed=1)  # experts take several 16-row chunks, in tiles of 4 and 1 rows
    together = run(k, x, ids, weights, *experts)
    for p in range(70):
        alone = run(k, x[p:p + 1], ids[p:p + 1], weights[p:p + 1], *experts)
        assert torch.equal(alone[0], together[p]), f"position {p} depends on the rest of the window"


def test_accumulate_adds_to_what_out_holds(k, experts):
    x, ids, weights = window(4, seed=2)
    base = torch.randn(4, H)
    got = run(k, x, ids, weights, *experts, out=base.clone(), accumulate=True)
    torch.testing.assert_close(got, base + reference(x, ids, weights, *experts), atol=1e-5, rtol=1e-5)
    overwritten = run(k, x, ids, weights, *experts, out=base.clone(), accumulate=False)
    torch.testing.assert_close(overwritten, reference(x, ids, weights, *experts), atol=1e-5, rtol=1e-5)


def test_ids_outside_the_experts_are_ignored(k, experts):
    x, ids, weights = window(2, seed=3)
    padded = ids.clone()
    padded[:, -1] = E + 5  # as if padded with an id no expert has
    dropped = weights.clone()
    dropped[:, -1] = 0.0
    torch.testing.assert_close(run(k, x, padded, weights, *experts), reference(x, ids, dropped, *experts),
                               atol=1e-5, rtol=1e-5)


def test_linear_matches_torch_and_is_row_independent(k):
    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(70, H, generator=g), torch.randn(6, H, generator=g)
    got = k.linear(x, PackedWeight.pack(weight))
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(k.linear(x[p:p + 1], PackedWeight.pack(weight))[0], got[p]) for p in range(6))


@pytest.mark.parametrize("bad, message", [
    ("transposed_x", "must be contiguous"),
    ("double_x", "float32"),
    ("int32_ids", "int64"),
    ("short_weights", "shapes disagree"),
    ("down_for_other_experts", "gate_up must be"),
])
def test_tensors_the_kernel_cannot_read_safely_are_refused_with_the_reason(k, experts, bad, message):
    gate_up, down = experts
    x, ids, weights = window(3, seed=5)
    out = torch.zeros(3, H)
    packed_down = PackedWeight.pack(down)
    if bad == "transposed_x":
        x = torch.randn(H, 3).t()
    elif bad == "double_x":
        x = x.double()
    elif bad == "int32_ids":
        ids = ids.int()
    elif bad == "short_weights":
        weights = weights[:2]
    elif bad == "down_for_other_experts":
        packed_down = PackedWeight.pack(down[:-1])
    with pytest.raises(ValueError, match=message):
        k.swiglu_experts(x, PackedWeight.pack(gate_up), packed_down, ids, weights, out, False)


def test_the_products_give_bitwise_the_same_result_on_every_build(ka, k):
    """Every build runs each output of a product as one fused multiply-add chain over k from 0 (kernels.h):
    the AVX-512 tiles, the loops as the compiler vectorises them for AVX2 and as scalar code agree to the
    bit, for every tile height (1-4 rows and their sums) and a last panel of 203 - 192 = 11 columns (a
    partial vector), on float32 and on bf16 panels."""
    g = torch.Generator().manual_seed(41)
    lm = torch.randn(203, H, generator=g)
    for bf16 in (False, True):
        weight = PackedWeight.pack(bf16_values(lm) if bf16 else lm, bf16)
        for rows in range(1, 10):
            x = torch.randn(rows, H, generator=g)
            assert torch.equal(ka.linear(x, weight), k.linear(x, weight)), (bf16, rows)


def test_bf16_panels_give_bitwise_the_float32_panels_result_for_weights_that_are_bf16_values(ka, block_weights):
    """Weights holding bf16 values (the shipped checkpoint's) are stored as bf16 panels and widened
    exactly on load: the MoE block, the experts, the output layer and attention give bitwise the fp32
    panels' results, in the AVX-512 and the portable build. Weights that are not bf16 values stay fp32
    (asking for bf16 is refused)."""
    bw = {name: bf16_values(w) for name, w in block_weights.items()}
    blocks = {bf16: kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                                     bw["shared_up"], bw["shared_down"], bf16=bf16) for bf16 in (False, True)}
    assert kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                            bw["shared_up"], bw["shared_down"]).bf16  # chosen by itself
    x, ids, weights = window(70, seed=19)
    for got, want in zip(ka.moe_block(blocks[True], x), ka.moe_block(blocks[False], x), strict=True):
        assert torch.equal(got, want)
    packed = {bf16: (PackedWeight.pack(bw["gate_up"], bf16), PackedWeight.pack(bw["down"], bf16)) for bf16 in (0, 1)}
    assert packed[1][0].tensor.dtype == torch.bfloat16 and packed[0][0].tensor.dtype == torch.float32
    outs = [torch.zeros_like(x) for _ in range(2)]
    for bf16, out in zip((0, 1), outs, strict=True):
        ka.swiglu_experts(x, *packed[bf16], ids, weights, out, False)
    assert torch.equal(outs[0], outs[1])
    lm = bf16_values(torch.randn(200, H, generator=torch.Generator().manual_seed(20)))
    assert torch.equal(ka.linear(x, PackedWeight.pack(lm, True)), ka.linear(x, PackedWeight.pack(lm, False)))
    aw = {name: bf16_values(w) for name, w in dict(qkv_weight=torch.randn((AH + 2 * AK) * AD, AHID),
                                                  o_weight=torch.randn(AHID, AH * AD)).items()}
    xa, positions, slots, k_cache, v_cache = ragged_pass([(2, 7, 3), (0, 0, 6)], seed=21)
    rows = []
    for bf16 in (False, True):
        attn = kernels.AttentionWeights(torch.ones(AHID), 1e-6, aw["qkv_weight"], torch.zeros((AH + 2 * AK) * AD),
                                        aw["o_weight"], AH, AK, AD, bf16=bf16)
        where = kernels.AttentionPass(positions, slots, k_cache.clone(), v_cache.clone(), *rope_tables(S, AD))
        rows.append(ka.attention_block(attn, where, 0, xa))
    assert torch.equal(rows[0], rows[1])
    assert not PackedWeight.pack(block_weights["down"]).bf16  # random fp32 values: kept fp32
    with pytest.raises(ValueError, match="bfloat16 cannot represent"):
        PackedWeight.pack(block_weights["down"], True)


def test_a_packed_weight_holds_the_transposed_weight_in_64_column_panels_and_refuses_other_layouts():
    weight = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)  # [out 70, in 3]: one full panel, one of 6
    packed = PackedWeight.pack(weight)
    assert packed.tensor.shape == (2, 3, 64) and (packed.out_features, packed.in_features) == (70, 3)
    assert torch.equal(packed.tensor[0], weight[:64].t()) and torch.equal(packed.tensor[1, :, :6], weight[64:].t())
    assert not packed.tensor[1, :, 6:].any()  # the padding is zero
    with pytest.raises(ValueError, match="contiguous"):
        PackedWeight(packed.tensor.transpose(0, 1), 70, 3)
    with pytest.raises(ValueError, match=r"does not hold a \[200, 3\] weight"):
        PackedWeight(packed.tensor, 200, 3)


def test_bf16_math_panels_hold_each_columns_weights_for_k_and_k_plus_1_side_by_side():
    weight = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)  # odd Kd: a zero pads the last pair
    packed = PackedWeight.pack(weight, BF16_MATH)
    assert packed.tensor.shape == (2, 2, 64, 2) and packed.tensor.dtype == torch.bfloat16
    assert (packed.out_features, packed.in_features, packed.format) == (70, 3, BF16_MATH)
    for c, k in [(0, 0), (5, 1), (63, 2), (64, 0), (69, 2)]:
        assert packed.tensor[c // 64, k // 2, c % 64, k % 2] == weight[c, k].bfloat16()
    assert not packed.tensor[:, 1, :, 1].any() and not packed.tensor[1, :, 6:].any()  # the padding is zero
    with pytest.raises(ValueError, match="format 2"):
        PackedWeight(packed.tensor.float(), 70, 3, BF16_MATH)


@pytest.mark.parametrize("Kd", [41, 256])
def test_bf16_math_is_the_float64_product_of_the_bf16_rounded_operands_within_float32_summation_error(kb, Kd):
    """Independent reference: torch rounds x and W to bf16 (round to nearest even) and multiplies in
    float64; the kernel's float32 sums of exact products may differ by at most the classic bound
    Kd * 2^-24 * (|x| @ |W|^T). The same bound rules out a kernel that skipped rounding x (checked:
    that product lies far outside it), so the test tells the two apart. Rows 1..9: every tile size."""
    g = torch.Generator().manual_seed(30)
    weight, x = torch.randn(200, Kd, generator=g), torch.randn(9, Kd, generator=g)
    xb, wb = x.bfloat16().double(), weight.bfloat16().double()
    want, bound = xb @ wb.T, (xb.abs() @ wb.abs().T) * Kd * 2.0 ** -24
    packed = PackedWeight.pack(weight, BF16_MATH)
    for n in range(1, 10):
        got = kb.linear(x[:n], packed).double()
        assert ((got - want[:n]).abs() <= bound[:n]).all(), f"{n} rows"
    unrounded = x.double() @ wb.T
    assert ((unrounded - want).abs() > bound).any()  # the negative control: not rounding x is caught


def test_bf16_math_gives_bitwise_the_same_result_on_every_build(kb, k, block_weights, attention_weights, request):
    """VDPBF16PS as this CPU runs it, its emulation by two FMAs per pair and the portable C agree to
    the bit on the products (the instruction's specified order: the odd product first, each sum
    rounded); with AVX-512 either way, also the whole MoE block and attention sub-block (the portable
    build's exp and dot differ from the vector ones outside the products, as in float32)."""
    weight = PackedWeight.pack(torch.randn(200, H, generator=torch.Generator().manual_seed(32)), BF16_MATH)
    x, _, _ = window(21, seed=31)
    assert torch.equal(kb.linear(x, weight), k.linear(x, weight))
    if "portable" in request.node.callspec.id:
        return
    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"], math="bf16")
    for got, want in zip(kb.moe_block(block, x), k.moe_block(block, x), strict=True):
        assert torch.equal(got, want)
    D = attention_weights["D"]
    aw = attention_weights
    attn = kernels.AttentionWeights(aw["norm_weight"], 1e-6, aw["qkv_weight"], aw["qkv_bias"], aw["o_weight"], AH, AK,
                                    D, math="bf16")
    xa, positions, slots, k_cache, v_cache = ragged_pass([(2, 7, 3), (0, 0, 6)], seed=33, D=D)
    rows = [lib.attention_block(attn, kernels.AttentionPass(positions, slots, k_cache.clone(), v_cache.clone(),
                                                            *rope_tables(S, D)), 0, xa) for lib in (kb, k)]
    assert torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("norm_topk", [False, True])
def test_the_moe_block_matches_the_textbook_block(k, block_weights, norm_topk):
    block = kernels.MoeBlock(block_weights["router_and_gate"], M, norm_topk, block_weights["gate_up"],
                             block_weights["down"], block_weights["shared_gate"], block_weights["shared_up"],
                             block_weights["shared_down"])
    x, _, _ = window(5, seed=7)
    out, logits, ids = k.moe_block(block, x)
    want_out, want_logits, want_ids = block_reference(x, block_weights, norm_topk)
    assert torch.equal(ids, want_ids)  # the same experts, in the same (descending) order
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for p in range(5):  # and each position alone gives bitwise the same row
        assert torch.equal(k.moe_block(block, x[p:p + 1])[0][0], out[p])


def test_a_moe_block_with_wrong_weights_is_refused_naming_the_tensor(block_weights):
    bad = dict(block_weights, down=block_weights["down"].transpose(1, 2))
    with pytest.raises(ValueError, match="down must be"):
        kernels.MoeBlock(bad["router_and_gate"], M, False, bad["gate_up"], bad["down"], bad["shared_gate"],
                         bad["shared_up"], bad["shared_down"])


def test_rms_norm_matches_the_formula(k):
    g = torch.Generator().manual_seed(8)
    x, weight = torch.randn(2, 3, H, generator=g), torch.randn(H, generator=g)
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(k.rms_norm(x, weight, 1e-6), want, atol=1e-6, rtol=1e-5)


def test_without_a_compiler_build_returns_none(tmp_path):
    assert kernels.build(cache_dir=tmp_path, compiler=str(tmp_path / "no-such-cc")) is None


def test_a_built_library_is_reused_from_the_cache(tmp_path):
    first = kernels.build(cache_dir=tmp_path)
    assert first is not None
    stamp = first.path.stat().st_mtime_ns
    second = kernels.build(cache_dir=tmp_path)
    assert second.path == first.path and second.path.stat().st_mtime_ns == stamp


def test_the_kernel_window_limit_decides_which_path_a_pass_takes(k):
    """A 32-position pass: past a limit of 16 it is bitwise the eager grouped path (the same module
    fused without kernels), within a limit of 128 bitwise the fused block."""
    from service.engine.model.layers import UNION_WINDOW_MAX
    from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference

    eager_model = load_for_inference(DEFAULT_TARGET_DIR)
    eager = eager_model.layers[0].mlp
    x = torch.randn(2 * UNION_WINDOW_MAX, eager_model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    narrow = load_for_inference(DEFAULT_TARGET_DIR, kernels=k, kernel_window_max=UNION_WINDOW_MAX).layers[0].mlp
    wide = load_for_inference(DEFAULT_TARGET_DIR, kernels=k, kernel_window_max=128).layers[0].mlp
    with torch.inference_mode():
        assert torch.equal(narrow(x)[0], eager(x)[0])
        assert torch.equal(wide(x)[0], wide.forward_kernel(x)[0])
        assert torch.equal(wide(x)[2], narrow(x)[2])  # the same routing either way
