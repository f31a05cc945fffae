"""Where the compiled kernel library lives, and the checks it passes before ctypes loads it.

Loading a shared library runs its code in the server, so a file at the expected path is never
trusted by its name alone. Contract of `cached_library(folder, name, compile_into)`:
- the cache folder is created 0700; an existing one must be a real folder owned by this user and
  not writable by group or others. Otherwise a warning names the problem and the library is built
  in a fresh private temporary folder instead (the caller removes it once the library is loaded).
- a cached library is used only if it is a regular file (not a symlink) of this user, not writable
  by group or others, and its SHA-256 equals the digest recorded beside it (`<name>.sha256`, written
  when it was built). Anything else is rebuilt over, with a warning.
- a fresh build is written 0600 with its digest (0600), both replaced atomically.
`compile_into(path)` must leave the finished library at `path` (atomically).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from service.security.private_files import UnsafePath, check_owned_private, private_dir

log = logging.getLogger(__name__)

DIGEST_SUFFIX = ".sha256"


def default_folder() -> Path:
    return Path.home() / ".cache" / "moespec" / "kernels"


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + DIGEST_SUFFIX)


def sha256_of(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def why_untrusted(library: Path) -> str | None:
    """None when the library may be loaded; otherwise the reason it may not."""
    try:
        st = os.lstat(library)
    except FileNotFoundError:
        return "not built yet"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a symlink?)"
    try:
        check_owned_private(st, library, "library")
        digest_file = digest_path(library)
        check_owned_private(os.lstat(digest_file), digest_file, "digest")
        fd = os.open(digest_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="ascii") as f:
            recorded = f.read().strip()
        actual = sha256_of(library)
    except FileNotFoundError:
        return "no recorded digest"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "its digest file is a symlink"
        return str(e)
    if recorded != actual:
        return f"its SHA-256 {actual[:16]}... differs from the recorded {recorded[:16]}..."
    return None


def cached_library(folder: Path, name: str,
                   compile_into: Callable[[Path], None]) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """(path of a library safe to load, the temporary folder holding it or None)."""
    try:
        folder = private_dir(folder)
    except UnsafePath as e:
        scratch = tempfile.TemporaryDirectory(prefix="moespec-kernels-")
        log.warning("kernel cache refused (%s): building in the private folder %s instead", e, scratch.name)
        library = Path(scratch.name) / name
        compile_into(library)
        return library, scratch
    library = folder / name
    reason = why_untrusted(library)
    if reason is None:
        return library, None
    if reason != "not built yet":
        log.warning("cached kernel library %s not loaded (%s): rebuilding it", library, reason)
    compile_into(library)  # os.replace: a symlink or planted file at that name is replaced, not followed
    os.chmod(library, 0o600)
    _write_digest(library)
    return library, None


def _write_digest(library: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=library.parent, prefix=".digest-")  # 0600
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(sha256_of(library) + "\n")
    os.replace(tmp, digest_path(library))  # atomic: a concurrent loader never reads half a digest
