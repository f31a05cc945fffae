"""The fused kernels' C compiles warning-free: the translation unit kernels.build compiles (every
service/engine/kernels/csrc/*.c in its order), with the project's own flags plus -Wall -Wextra -Werror, in
each build the engine can pick (AVX-512 with and without its bf16 instructions, and portable C)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from service.engine.kernels import library as kernels

COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(COMPILER is None, reason="no C compiler on the PATH: the engine runs its eager step")
@pytest.mark.parametrize("build", [(), ("-mno-avx512bf16",), ("-mno-avx512f",)],
                         ids=["native", "avx512-without-bf16", "portable"])
def test_the_kernels_compile_without_a_warning(tmp_path, build):
    source = tmp_path / "kernels.c"
    source.write_text(kernels._SOURCE)
    done = subprocess.run([COMPILER, *kernels._FLAGS, *build, "-Wall", "-Wextra", "-Werror", str(source),
                           "-o", str(tmp_path / "kernels.so")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
