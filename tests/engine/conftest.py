"""The fused kernels as built for this CPU and its other builds, and the weights their tests share."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import library as kernels
from tests.support.kernel_cases import AD, AH, AHID, AK, AVX2, AVX512_WITHOUT_BF16, IS, PORTABLE, E, H, I, cpu_has


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


# ------------------------------------------------------------------------------- bf16 arithmetic
@pytest.fixture(scope="module", params=["native", "avx512-without-bf16", "portable"])
def kb(request, k, tmp_path_factory) -> kernels.Kernels:
    """This CPU's build (VDPBF16PS where it has it), AVX-512 emulating it with FMAs, and portable C."""
    if request.param == "native":
        return k
    flags = AVX512_WITHOUT_BF16 if request.param == "avx512-without-bf16" else PORTABLE
    built = kernels.build(cache_dir=tmp_path_factory.mktemp(request.param), extra_flags=flags)
    assert built is not None and not built.bf16_dot_native and not built.amx_native
    return built


@pytest.fixture(scope="module")
def block_weights():
    g = torch.Generator().manual_seed(6)
    return dict(router_and_gate=torch.randn(E + 1, H, generator=g), gate_up=torch.randn(E, 2 * I, H, generator=g) * 0.2,
                down=torch.randn(E, H, I, generator=g) * 0.2, shared_gate=torch.randn(IS, H, generator=g) * 0.2,
                shared_up=torch.randn(IS, H, generator=g) * 0.2, shared_down=torch.randn(H, IS, generator=g) * 0.2)


@pytest.fixture(scope="module", params=[2, 3, 8])
def pool(request, k):
    """A started pool of 2, 3 and 8 threads (8: more than most passes here have panels or positions)."""
    started = k.pool(request.param)
    yield started
    started.close()


# ------------------------------------------------------------------------------- attention sub-block
@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def ka(request, k, tmp_path_factory) -> kernels.Kernels:
    """The library as built for this CPU, its AVX2 build (where the CPU runs it) and its portable C,
    as CPUs without AVX-512 (or AVX2) run them."""
    if request.param == "native":
        return k
    if request.param == "avx2" and not (cpu_has("avx2") and cpu_has("fma")):
        pytest.skip("this CPU does not run AVX2 with FMA")
    flags = AVX2 if request.param == "avx2" else PORTABLE
    built = kernels.build(cache_dir=tmp_path_factory.mktemp(request.param), extra_flags=flags)
    assert built is not None
    return built


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
