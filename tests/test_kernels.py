"""The fused C kernels compute what a per-position PyTorch reference computes, each position
independently of the rest of its window (so a verify pass and a plain step agree bitwise), and
refuse tensors they would read out of bounds. Model-level parity with transformers is in
test_model_parity.py (the "fast" loader)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine import kernels

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
    k.swiglu_experts(x, gate_up[:, :I], gate_up[:, I:], down, ids, weights, out, accumulate)
    return out


@pytest.mark.parametrize("w", [1, 3, 16])
def test_fused_experts_match_a_per_position_reference(k, experts, w):
    x, ids, weights = window(w, seed=w)
    torch.testing.assert_close(run(k, x, ids, weights, *experts), reference(x, ids, weights, *experts),
                               atol=1e-5, rtol=1e-5)


def test_each_position_is_bitwise_the_same_alone_or_in_a_window(k, experts):
    x, ids, weights = window(9, seed=1)
    together = run(k, x, ids, weights, *experts)
    for p in range(9):
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
    got = k.linear(x, weight)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(k.linear(x[p:p + 1], weight)[0], got[p]) for p in range(6))


@pytest.mark.parametrize("bad, message", [
    ("transposed_x", "must be contiguous"),
    ("double_x", "float32"),
    ("int32_ids", "int64"),
    ("short_weights", "shapes disagree"),
    ("strided_rows", "rows must be contiguous"),
])
def test_tensors_the_kernel_cannot_read_safely_are_refused_with_the_reason(k, experts, bad, message):
    gate_up, down = experts
    x, ids, weights = window(3, seed=5)
    out = torch.zeros(3, H)
    gate, up = gate_up[:, :I], gate_up[:, I:]
    if bad == "transposed_x":
        x = torch.randn(H, 3).t()
    elif bad == "double_x":
        x = x.double()
    elif bad == "int32_ids":
        ids = ids.int()
    elif bad == "short_weights":
        weights = weights[:2]
    elif bad == "strided_rows":
        gate, up = gate_up[:, :I, ::2], gate_up[:, I:, ::2]
    with pytest.raises(ValueError, match=message):
        k.swiglu_experts(x, gate, up, down, ids, weights, out, False)


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
