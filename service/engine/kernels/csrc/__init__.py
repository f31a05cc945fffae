"""The C sources of the fused kernels, shipped as package data and compiled by kernels.build.

They form one translation unit, concatenated in the order library.py gives (kernel_pool.c,
common.c, bf16.c, matmul.c, moe.c, attention.c, head.c, decoder.c): later files use the helpers of
earlier ones, so a file alone does not compile. Each is read where its Python wrapper lives.
"""

from __future__ import annotations

from importlib import resources


def read(name: str) -> str:
    """The text of one C file of this folder."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
