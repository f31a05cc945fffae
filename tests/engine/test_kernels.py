"""The fused C kernels compute what a per-position PyTorch reference computes, each position
independently of the rest of its window (so a verify pass and a plain step agree bitwise), and
refuse tensors they would read out of bounds. Model-level parity with transformers is in
test_model_parity.py (the "fast" loader)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from service.engine import kernels
from service.engine.packed import BF16_MATH, PackedWeight

# Sizes that are not multiples of the SIMD width, so the remainder loops run too.
E, H, I, M = 10, 40, 24, 3


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    built = kernels.build()
    assert built is not None, "the kernels did not build (no C compiler?)"
    return built


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.2  # [E, 2I, H] as Experts stores it
    down = torch.randn(E, H, I, generator=g) * 0.2  # [E, H, I]
    return gate_up, down


def window(w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:M] for _ in range(w)])  # distinct per row
    weights = torch.rand(w, M, generator=g)
    return x, ids, weights


def reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """Each position through each of its experts with F.linear, the textbook formula."""
    out = torch.zeros_like(x)
    for p in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[p, j])
            g, u = F.linear(x[p], gate_up[e]).chunk(2)
            out[p] += weights[p, j] * F.linear(F.silu(g) * u, down[e])
    return out


def run(k, x, ids, weights, gate_up, down, out=None, accumulate=False) -> torch.Tensor:
    out = torch.zeros_like(x) if out is None else out
    k.swiglu_experts(x, PackedWeight.pack(gate_up), PackedWeight.pack(down), ids, weights, out, accumulate)
    return out


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


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


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


# ------------------------------------------------------------------------------- bf16 arithmetic
@pytest.fixture(scope="module", params=["native", "avx512-without-bf16", "portable"])
def kb(request, k, tmp_path_factory) -> kernels.Kernels:
    """This CPU's build (VDPBF16PS where it has it), AVX-512 emulating it with FMAs, and portable C."""
    if request.param == "native":
        return k
    flag = "-mno-avx512bf16" if request.param == "avx512-without-bf16" else "-mno-avx512f"
    built = kernels.build(cache_dir=tmp_path_factory.mktemp(request.param), extra_flags=(flag,))
    assert built is not None and not built.bf16_dot_native
    return built


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


IS = 32  # shared expert intermediate


@pytest.fixture(scope="module")
def block_weights():
    g = torch.Generator().manual_seed(6)
    return dict(router_and_gate=torch.randn(E + 1, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g) * 0.2,
                down=torch.randn(E, H, I, generator=g) * 0.2, shared_gate=torch.randn(IS, H, generator=g) * 0.2,
                shared_up=torch.randn(IS, H, generator=g) * 0.2, shared_down=torch.randn(H, IS, generator=g) * 0.2)


def block_reference(x, bw, norm_topk):
    """Qwen2-MoE's block as transformers writes it: softmax, top-k, routed + sigmoid-gated shared."""
    logits = F.linear(x, bw["router_and_gate"])  # [w, E+1]
    probs = logits[:, :E].softmax(-1)
    weights, ids = probs.topk(M, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    routed = reference(x, ids, weights, bw["gate_up"], bw["down"])
    g, u = F.linear(x, bw["shared_gate"]), F.linear(x, bw["shared_up"])
    shared = F.linear(F.silu(g) * u, bw["shared_down"]) * torch.sigmoid(logits[:, E:])
    return routed + shared, logits[:, :E], ids


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


@pytest.fixture(scope="module", params=[2, 3, 8])
def pool(request, k):
    """A started pool of 2, 3 and 8 threads (8: more than most passes here have panels or positions)."""
    started = k.pool(request.param)
    yield started
    started.close()


@pytest.mark.parametrize("math", ["fp32", "bf16"])
@pytest.mark.parametrize("w", [1, 2, 5, 16, 17, 70])
def test_splitting_a_pass_over_threads_changes_no_bit(k, block_weights, pool, w, math):
    """The MoE block split over a pool's threads (by expert up to 16 positions, by position past that)
    and the output layer's columns split give bitwise the one-thread result, also with more threads than
    positions, experts or panels; and each position's row is bitwise its row alone, in either arithmetic."""
    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"], math=math)
    x, _, _ = window(w, seed=15)
    alone = k.moe_block(block, x)
    for got, want in zip(k.moe_block(block, x, pool), alone, strict=True):
        assert torch.equal(got, want)
    for p in {0, w - 1}:
        assert torch.equal(k.moe_block(block, x[p:p + 1])[0][0], alone[0][p])
    weight = PackedWeight.pack(torch.randn(200, H, generator=torch.Generator().manual_seed(16)),
                               BF16_MATH if math == "bf16" else None)  # 4 panels
    assert torch.equal(k.linear(x[:10], weight, pool), k.linear(x[:10], weight))
    assert torch.equal(k.linear(x[:1], weight)[0], k.linear(x[:10], weight)[0])


def test_a_pool_serves_one_caller_at_a_time_and_runs_alone_once_closed(k, block_weights):
    """Two threads calling one pool at once both get the right rows (the second runs its call alone);
    a closed pool's calls run on the calling thread."""
    from concurrent.futures import ThreadPoolExecutor

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, True, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    inputs = [window(64, seed=s)[0] for s in range(8)]
    want = [k.moe_block(block, x)[0] for x in inputs]
    shared = k.pool(2)
    with ThreadPoolExecutor(4) as callers:
        for _ in range(5):
            got = list(callers.map(lambda x: k.moe_block(block, x, shared)[0], inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    shared.close()
    assert shared.handle is None and torch.equal(k.moe_block(block, inputs[0], shared)[0], want[0])


def test_a_pool_whose_workers_the_os_keeps_waiting_still_gives_every_call_bitwise_its_result(k, block_weights):
    """Two busy processes hold this machine's cores, so the OS often runs the caller while a worker waits
    for a core (or the reverse): ranges are claimed by whoever runs, and the caller waits only for ranges
    another thread claimed. 400 calls of random sizes (by expert and by position) must each come out
    bitwise the one-thread result, and none may hang."""
    import subprocess
    import sys

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    g = torch.Generator().manual_seed(19)
    inputs = [window(int(torch.randint(1, 70, (1,), generator=g)), seed=100 + i)[0] for i in range(40)]
    want = [k.moe_block(block, x)[0] for x in inputs]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    started = k.pool(2)
    try:
        for i in range(400):
            assert torch.equal(k.moe_block(block, inputs[i % 40], started)[0], want[i % 40])
    finally:
        started.close()
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_forked_child_runs_its_calls_alone_instead_of_waiting_for_workers_it_does_not_have(k, block_weights):
    import os

    bw = block_weights
    block = kernels.MoeBlock(bw["router_and_gate"], M, False, bw["gate_up"], bw["down"], bw["shared_gate"],
                             bw["shared_up"], bw["shared_down"])
    x, _, _ = window(40, seed=18)
    want = k.moe_block(block, x)[0]
    started = k.pool(2)
    child = os.fork()
    if child == 0:  # the child: exit 0 only if the call returns the right rows
        os._exit(0 if torch.equal(k.moe_block(block, x, started)[0], want) else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(child, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(child, 9)
        os.waitpid(child, 0)
    started.close()
    assert done != (0, 0), "the forked child hung waiting for the pool's workers"
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_kernel_threads_split_only_passes_past_each_kernels_minimum(k):
    started = k.pool(4)
    split = kernels.KernelThreads(started, moe_min_positions=4, linear_min_positions=8, attention_min_positions=32)
    assert split.threads == 4
    assert [split.moe(n) for n in (1, 3, 4, 100)] == [None, None, started, started]
    assert [split.linear(n) for n in (7, 8)] == [None, started]
    assert [split.attention(n) for n in (31, 32)] == [None, started]
    assert "from 4 positions in the MoE block, 8 in the output layer, 32 in attention" in split.describe()
    assert kernels.ONE_THREAD.moe(1000) is None and "no pass is split" in kernels.ONE_THREAD.describe()
    started.close()
    with pytest.raises(ValueError, match="kernel threads must be an int >= 1, got 0"):
        k.pool(0)


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
    from service.engine.model import UNION_WINDOW_MAX
    from service.engine.weights import DEFAULT_TARGET_DIR, load_for_inference

    eager_model = load_for_inference(DEFAULT_TARGET_DIR)
    eager = eager_model.layers[0].mlp
    x = torch.randn(2 * UNION_WINDOW_MAX, eager_model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    narrow = load_for_inference(DEFAULT_TARGET_DIR, kernels=k, kernel_window_max=UNION_WINDOW_MAX).layers[0].mlp
    wide = load_for_inference(DEFAULT_TARGET_DIR, kernels=k, kernel_window_max=128).layers[0].mlp
    with torch.inference_mode():
        assert torch.equal(narrow(x)[0], eager(x)[0])
        assert torch.equal(wide(x)[0], wide.forward_kernel(x)[0])
        assert torch.equal(wide(x)[2], narrow(x)[2])  # the same routing either way


# ------------------------------------------------------------------------------- attention sub-block
@pytest.fixture(scope="module", params=["native", "portable"])
def ka(request, k, tmp_path_factory) -> kernels.Kernels:
    """The library as built for this CPU, and its portable C (no AVX-512) as a CPU without it runs."""
    if request.param == "native":
        return k
    built = kernels.build(cache_dir=tmp_path_factory.mktemp("portable"), extra_flags=("-mno-avx512f",))
    assert built is not None
    return built


# GQA with two query heads per kv head; a hidden size off the SIMD width (remainder loops); 24 cache
# positions, so a token late in a slot attends over one block of 16 keys and part of the next.
AH, AK, AD, AHID, SLOTS, S = 4, 2, 10, 40, 3, 24


@pytest.fixture(scope="module", params=[AD, 32])
def attention_weights(request):
    """Head dim 10 (off the SIMD width: the scalar attention loops) and 32 (the vector path: scores of
    16 keys at a time)."""
    D = request.param
    g = torch.Generator().manual_seed(9)
    R = (AH + 2 * AK) * D
    return dict(norm_weight=1 + 0.1 * torch.randn(AHID, generator=g),
                qkv_weight=torch.randn(R, AHID, generator=g) * 0.3, qkv_bias=torch.randn(R, generator=g) * 0.1,
                o_weight=torch.randn(AHID, AH * D, generator=g) * 0.3, D=D)


def rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # [P, D]
    return angles.cos(), angles.sin()


def attention_reference(x, positions, slots, k_cache, v_cache, w, eps=1e-6):
    """The textbook sub-block, token by token, on copies of the caches (returned updated): RMSNorm,
    q/k/v with F.linear, rope as x cos + rotate_half(x) sin, the cache write, then softmax attention
    of each query head over its kv head's keys 0..position of the token's slot, o_proj, residual."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    D = w["D"]  # noqa: N806 (the shape legend's name)
    cos, sin = rope_tables(S, D)

    def rope(h, p):  # h [heads, D]
        rotated = torch.cat((-h[:, D // 2:], h[:, :D // 2]), dim=-1)
        return h * cos[p] + rotated * sin[p]

    qs = []
    for t in range(x.shape[0]):
        p, s = int(positions[t]), int(slots[t])
        h = w["norm_weight"] * (x[t] * torch.rsqrt(x[t].pow(2).mean() + eps))
        q, k, v = F.linear(h, w["qkv_weight"], w["qkv_bias"]).split([AH * D, AK * D, AK * D])
        qs.append(rope(q.view(AH, D), p))
        k_cache[0, s, :, p] = rope(k.view(AK, D), p)
        v_cache[0, s, :, p] = v.view(AK, D)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        p, s = int(positions[t]), int(slots[t])
        heads = []
        for a in range(AH):
            kv = a // (AH // AK)
            keys, values = k_cache[0, s, kv, :p + 1], v_cache[0, s, kv, :p + 1]  # [p+1, D]
            heads.append(torch.softmax(keys @ qs[t][a] / D ** 0.5, dim=0) @ values)
        out[t] = x[t] + F.linear(torch.cat(heads), w["o_weight"])
    return out, k_cache, v_cache


def ragged_pass(windows: list[tuple[int, int, int]], seed: int, D: int = AD):  # noqa: N803
    """windows (slot, start, length) -> x [N, AHID], positions [N], slots [N] and caches [1, SLOTS, K, S, D]
    full of random keys/values (the prefixes every window attends to, and stale entries past them)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in windows])
    slots = torch.cat([torch.full((n,), slot) for slot, _, n in windows])
    caches = [torch.randn(1, SLOTS, AK, S, D, generator=g) for _ in range(2)]
    return torch.randn(positions.shape[0], AHID, generator=g), positions, slots, *caches


def run_attention(ka, w, x, positions, slots, k_cache, v_cache, pool=None, kv_only=False):
    """The kernel on the given caches (written in place) -> out [N, AHID] (None when kv_only)."""
    weights = kernels.AttentionWeights(w["norm_weight"], 1e-6, w["qkv_weight"], w["qkv_bias"], w["o_weight"],
                                       AH, AK, w["D"])
    where = kernels.AttentionPass(positions, slots, k_cache, v_cache, *rope_tables(S, w["D"]))
    return ka.attention_block(weights, where, 0, x, pool, kv_only=kv_only)


# A window at position 0, one at position 1, a verify window after a long prefix, and a ragged pass of
# three slots with different starts and lengths (one of them a prefill from position 0).
PASSES = {"first-position": [(0, 0, 1)], "second-position": [(1, 1, 1)], "long-prefix": [(2, 19, 5)],
          "ragged": [(2, 7, 3), (0, 0, 6), (1, 15, 1)]}


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
    """Counted on the real kernel (wrapped, still run): a pass calls it once per layer whether or not
    it is longer than the MoE kernel's window (prefill passes take it too); a model fused with
    fused_attention=False never does (eager SDPA)."""
    from service.engine.model import KVCache
    from service.engine.weights import DEFAULT_TARGET_DIR, load_for_inference

    calls = []

    class Counting(kernels.Kernels):
        def attention_block(self, *args):
            calls.append(args[2])  # the layer
            return super().attention_block(*args)

    counting = Counting(k.path)
    ids = torch.randint(1, 4000, (32,), generator=torch.Generator().manual_seed(5))
    cases = [(16, True, 16, 4), (16, True, 32, 4), (128, True, 32, 4), (128, False, 32, 0)]
    for limit, fused, n, want in cases:
        model = load_for_inference(DEFAULT_TARGET_DIR, kernels=counting, kernel_window_max=limit,
                                   fused_attention=fused)
        calls.clear()
        with torch.inference_mode():
            model.forward(ids[:n], 0, KVCache(model.cfg, 64))
        assert calls == list(range(want)), (limit, fused, n)
