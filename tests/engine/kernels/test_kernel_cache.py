"""The kernel cache never loads a library it cannot vouch for: the folder is private (0700), and a
`.so` at the expected name is loaded only if it is this user's, not writable by others, and matches
the SHA-256 recorded when it was built. A planted library (here one whose load-time constructor
would create a marker file) is rebuilt over, never run. Builds with the real C compiler."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from service.engine.kernels import library as kernels
from service.engine.kernels.cache import digest_path, sha256_of

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")

PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def plant_library(at, marker, tmp_path):
    """A shared library that creates `marker` as soon as it is loaded."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C % marker)
    compiler = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(at)], check=True, timeout=60)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build: the library's name and bytes (each test copies them into its own cache)."""
    folder = tmp_path_factory.mktemp("pristine") / "kernels"
    old = os.umask(0o002)
    try:
        k = kernels.build(cache_dir=folder)
    finally:
        os.umask(old)
    assert k is not None
    return folder, k.path


def test_a_fresh_cache_is_0700_with_a_0600_library_and_its_recorded_digest(built):
    folder, library = built
    assert mode(folder) == 0o700
    assert mode(library) == 0o600 and mode(digest_path(library)) == 0o600
    assert digest_path(library).read_text().strip() == sha256_of(library)


def test_a_verified_library_is_reused(built, tmp_path):
    folder, library = built
    cache = tmp_path / "kernels"
    shutil.copytree(folder, cache)
    stamp = (cache / library.name).stat().st_mtime_ns
    again = kernels.build(cache_dir=cache)
    assert again.path == cache / library.name and again.path.stat().st_mtime_ns == stamp


def test_a_planted_library_without_a_matching_digest_is_rebuilt_not_loaded(built, tmp_path):
    folder, library = built
    cache = tmp_path / "kernels"
    shutil.copytree(folder, cache)
    marker = tmp_path / "planted-code-ran"
    plant_library(cache / library.name, marker, tmp_path)  # the recorded digest is the real build's
    k = kernels.build(cache_dir=cache)
    assert not marker.exists(), "the planted library was loaded"
    assert k is not None and sha256_of(k.path) == digest_path(k.path).read_text().strip()
    assert sha256_of(k.path) == sha256_of(library)  # the real kernels again


def test_a_planted_library_with_no_digest_is_not_loaded(built, tmp_path):
    _, library = built
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "planted-code-ran"
    plant_library(cache / library.name, marker, tmp_path)
    assert kernels.build(cache_dir=cache) is not None
    assert not marker.exists()


def test_a_library_others_may_write_is_not_loaded_even_with_a_matching_digest(built, tmp_path):
    folder, library = built
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "planted-code-ran"
    plant_library(cache / library.name, marker, tmp_path)
    digest_path(cache / library.name).write_text(sha256_of(cache / library.name) + "\n")
    (cache / library.name).chmod(0o666)
    assert kernels.build(cache_dir=cache) is not None
    assert not marker.exists()


def test_a_world_writable_cache_folder_is_not_used(built, tmp_path):
    folder, library = built
    shared = tmp_path / "shared-cache"
    shutil.copytree(folder, shared)
    shared.chmod(0o777)
    marker = tmp_path / "planted-code-ran"
    plant_library(shared / library.name, marker, tmp_path)
    digest_path(shared / library.name).write_text(sha256_of(shared / library.name) + "\n")
    k = kernels.build(cache_dir=shared)
    assert k is not None and not marker.exists()
    assert k.path.parent != shared  # built in a private temporary folder instead


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_not_used(built, tmp_path):
    folder, library = built
    theirs = tmp_path / "their-cache"
    shutil.copytree(folder, theirs)
    marker = tmp_path / "planted-code-ran"
    plant_library(theirs / library.name, marker, tmp_path)
    digest_path(theirs / library.name).write_text(sha256_of(theirs / library.name) + "\n")
    for path in (theirs, theirs / library.name, digest_path(theirs / library.name)):
        os.chown(path, 65534, 65534)
    k = kernels.build(cache_dir=theirs)
    assert k is not None and not marker.exists() and k.path.parent != theirs
