"""The C of service/engine/kernels/csrc compiles warning-free, with the project's own flags plus -Wall
-Wextra -Werror, in each build the engine can pick (AVX-512 with and without its bf16 instructions,
AVX2 with FMA, and portable C; on x86 the AVX-512 code is compiled even where this CPU has none): each library as the
build compiles it (its unity file, one compiler call), and every file and header alone (each
includes what it uses)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from service.engine.kernels import c_build, csrc
from tests.support.kernel_cases import PORTABLE

COMPILER = shutil.which("cc") or shutil.which("gcc")
WARNINGS = ("-Wall", "-Wextra", "-Werror")
UNITY_FILES = ("unity_kernels.c", "unity_probe.c")
BUILDS = {"native": (), "avx512-without-bf16": ("-mno-avx512bf16",), "portable": PORTABLE}
if platform.machine() in ("x86_64", "AMD64"):
    BUILDS |= {"avx2": ("-march=x86-64-v3",), "avx512": ("-march=x86-64-v4",),
               "avx512-bf16": ("-march=x86-64-v4", "-mavx512bf16")}

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler on the PATH: the engine runs its eager step")


@pytest.mark.parametrize("unity", UNITY_FILES)
@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_each_library_compiles_without_a_warning(tmp_path, unity, build):
    try:
        library = c_build.build_library(unity, lambda path: path, tmp_path, extra_flags=(*build, *WARNINGS))
    except subprocess.CalledProcessError as e:
        pytest.fail(e.stderr.decode()[-4000:])
    assert library.is_file()


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_every_file_compiles_alone(build):
    folder = Path(csrc.__file__).parent
    failed = {}
    for name in csrc.files():
        if name in UNITY_FILES:
            continue  # compiled whole above
        done = subprocess.run([COMPILER, "-fsyntax-only", "-x", "c", *c_build.FLAGS, *build, *WARNINGS,
                               str(folder / name)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failed[name] = done.stderr[-2000:]
    assert not failed, failed
