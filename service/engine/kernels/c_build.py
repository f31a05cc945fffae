"""How a library of csrc/ is built: one compiler call on one unity file, cached per source and CPU.

`build_library(unity, load)` copies every C file and header of csrc/ into a private temporary
folder, compiles csrc/<unity> there in one call (`cc FLAGS -I <folder> <unity> -o <library> -lm`) and
returns load(path of the library) once kernel_cache has vouched for it (folder, owner, permissions,
recorded SHA-256). Compiling the copy means the build reads exactly the bytes its cache key was
computed from: the key covers the unity file's name, every copied file (names and bytes, so a change
to any .c or .h rebuilds), the flags, the compiler and this CPU's feature flags (so a shared home
folder never serves code built for another CPU).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from service.engine.kernels import cache as kernel_cache
from service.engine.kernels import csrc

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-pthread")
# After FLAGS: the code without the AVX-512 tiles it picks by itself, without the AMX tile unit, and
# without AVX2 or FMA instructions for the compiler to vectorise with, as a CPU without any runs it
# (the kernels' tests hold every build to the same bits).
NO_AMX_FLAGS = ("-mno-amx-tile",)  # (the AMX bf16 and int8 extensions go with it)
PORTABLE_FLAGS = ("-mno-avx512f", "-mno-avx2", "-mno-fma", *NO_AMX_FLAGS)

T = TypeVar("T")


class NoCompiler(OSError):
    """No C compiler was given or found on the PATH."""


def find_compiler(compiler: str | None = None) -> str:
    """The compiler to call: the one given, else `cc` or `gcc` on the PATH."""
    found = compiler or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise NoCompiler("no C compiler on the PATH")
    return found


def build_library(unity: str, load: Callable[[Path], T], cache_dir: Path | None = None,
                  compiler: str | None = None, extra_flags: tuple[str, ...] = ()) -> T:
    """load(path) of csrc/<unity> compiled (or reused from the cache). cache_dir defaults to
    ~/.cache/moespec/kernels, compiler to `cc` on the PATH; extra_flags go after FLAGS (tests build the
    portable code with PORTABLE_FLAGS). Raises NoCompiler, or OSError / subprocess.SubprocessError
    when the build fails."""
    flags = (*FLAGS, *extra_flags)
    compiler = find_compiler(compiler)
    sources = csrc.files()
    if unity not in sources:
        raise FileNotFoundError(f"no {unity} among the C sources")
    folder = Path(cache_dir) if cache_dir else kernel_cache.default_folder()
    name = f"{Path(unity).stem}-{cache_key(unity, sources, flags, compiler)[:16]}.so"
    library, scratch = kernel_cache.cached_library(folder, name,
                                                   lambda path: _compile(compiler, flags, sources, unity, path))
    try:
        return load(library)
    finally:
        if scratch is not None:
            scratch.cleanup()  # a loaded library stays mapped


def cache_key(unity: str, sources: dict[str, bytes], flags: tuple[str, ...], compiler: str) -> str:
    """The hex SHA-256 a built library is cached under: every input of the build."""
    key = hashlib.sha256()
    for part in (unity, *flags, compiler, platform.machine(), _cpu_flags()):
        key.update(part.encode() + b"\0")
    for name, text in sorted(sources.items()):
        key.update(name.encode() + b"\0" + len(text).to_bytes(8, "little") + text)
    return key.hexdigest()


def _compile(compiler: str, flags: tuple[str, ...], sources: dict[str, bytes], unity: str, library: Path) -> None:
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        folder = Path(tmp)
        for name, text in sources.items():
            (folder / name).write_bytes(text)
        built = folder / library.name
        subprocess.run([compiler, *flags, "-I", str(folder), str(folder / unity), "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: a concurrent builder never loads half a file


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
