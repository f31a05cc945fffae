"""Files and folders only this user may read: token ids of step recordings, kept SGLang records, a
tuner's study, the compiled kernel cache.

Contract:
- `open_private(path, append=...)` creates the file 0600 (or opens an existing one) without following
  a symlink at the last path component (O_NOFOLLOW); an existing file must be a regular file owned by
  this user, and is narrowed to 0600 if it was wider. A symlink, another user's file or a non-file
  raises `UnsafePath` naming the path and the problem.
- `private_dir(path)` creates a folder 0700 (parents as needed) or accepts an existing one that is a
  real folder (not a symlink) owned by this user and writable by nobody else; otherwise `UnsafePath`.
- `make_private(path)` narrows a file another library wrote (under its umask) to 0600.
- `check_owned_private(st, path)` is the ownership / permission check both use (for callers that
  already hold a stat result, e.g. the kernel cache checking its library).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafePath(OSError):
    """A path that someone else could write to, or that leads somewhere else (a symlink)."""


def check_owned_private(st: os.stat_result, path: Path, kind: str) -> None:
    """Refuse what another user owns or may write (group / world write bits)."""
    if st.st_uid != os.getuid():
        raise UnsafePath(f"{path}: the {kind} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{path}: the {kind} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def open_private(path: Path, append: bool = True, encoding: str = "utf-8") -> IO[str]:
    """A text file opened for writing (appending, or truncated with append=False), mode 0600."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path}: is a symlink; refusing to follow it for a private file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        if st.st_uid != os.getuid():
            raise UnsafePath(f"{path}: the file is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)  # an older file made under a wider umask: narrow it
        return os.fdopen(fd, "a" if append else "w", encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def create_private(path: Path) -> None:
    """Make sure `path` exists as a private regular file (for files another library then opens)."""
    open_private(path, append=True).close()


def write_private_text(path: Path, text: str) -> None:
    with open_private(path, append=False) as f:
        f.write(text)


def make_private(path: Path) -> None:
    """Narrow an existing regular file (written by another library under its umask) to 0600."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path}: is a symlink; refusing it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise UnsafePath(f"{path}: not a regular file of this user")
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """The folder, created 0700 if missing; an existing one must be this user's and not shared-writable."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=False)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path}: is a symlink; refusing it as a private folder")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path}: not a folder")
    check_owned_private(st, path, "folder")
    return path
