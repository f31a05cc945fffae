"""The C build (c_build.py): a library's cache key covers every C file and header it could read, and
the kernels' library carries no benchmark code (the machine probes are a library of their own)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from service.engine.kernels import c_build, csrc
from service.engine.kernels.library import Kernels


def test_the_build_reads_every_c_file_and_header_of_csrc():
    folder = Path(csrc.__file__).parent
    on_disk = sorted(p.name for p in folder.iterdir() if p.suffix in (".c", ".h"))
    assert sorted(csrc.files()) == on_disk
    assert {"kernels.h", "kernel_pool.h", "linkage.h", "unity_kernels.c", "unity_probe.c"} <= set(on_disk)


def test_a_change_to_any_c_file_or_header_changes_the_cache_key():
    sources = csrc.files()
    key = c_build.cache_key("unity_kernels.c", sources, c_build.FLAGS, "cc")
    for name, text in sources.items():
        changed = dict(sources, **{name: text + b"\n"})
        assert c_build.cache_key("unity_kernels.c", changed, c_build.FLAGS, "cc") != key, name
    assert c_build.cache_key("unity_probe.c", sources, c_build.FLAGS, "cc") != key
    assert c_build.cache_key("unity_kernels.c", sources, (*c_build.FLAGS, "-mno-avx512f"), "cc") != key
    assert c_build.cache_key("unity_kernels.c", sources, c_build.FLAGS, "gcc") != key


def test_the_kernels_library_has_no_probe(k):
    lib = ctypes.CDLL(str(k.path))
    assert lib.moe_block is not None
    for name in ("probe_read", "probe_fma"):
        assert not hasattr(lib, name)
        assert not hasattr(Kernels, name)
