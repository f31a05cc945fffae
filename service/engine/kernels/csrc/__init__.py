"""The C sources of the fused kernels, shipped as package data and compiled by c_build.py.

What the files share is declared in headers: kernel_pool.h (the worker pool), kernels.h (the packed
panels' layout, the tile macros, the helpers later files call, every entry point) and head.h (the draft
head's weights and the steps its chain and its tree share); linkage.h
makes those helpers static in a library's build and extern in a file compiled alone. Every file
includes what it uses, so each compiles alone (tests/engine/kernels/test_csrc_warnings.py checks it).

A library is one translation unit: a unity file that includes the sources in a declared order and is
compiled by one compiler call. unity_kernels.c is the kernels' library (library.py); unity_probe.c,
the pool and probe.c, is the step limit's machine probes (probe.py), which the engine never loads.
"""

from __future__ import annotations

from importlib import resources

C_SUFFIXES = (".c", ".h")


def files() -> dict[str, bytes]:
    """Every C source and header of this folder, by name: what a build copies, compiles and keys its
    cache by (read through importlib.resources, so an installed package serves them too)."""
    folder = resources.files(__name__)
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.is_file() and f.name.endswith(C_SUFFIXES)}
