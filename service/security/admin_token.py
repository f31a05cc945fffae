"""Where a command gets the admin token: --admin-token-file, --admin-token, or $MOESPEC_ADMIN_TOKEN.

One set of flags for `serve`, `tune` and `client`, one resolution rule: the file (first line,
surrounding whitespace stripped) or the flag, else the environment variable, else None. The flag
is kept for scripts, but its help says what it costs: a command line is visible to every user of
the machine (`ps`, /proc/PID/cmdline).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from service.errors import UsageError

ADMIN_TOKEN_ENV = "MOESPEC_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, purpose: str) -> None:
    """`purpose` completes "bearer token ..." in the help, e.g. "PolicyAdmin requires"."""
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--admin-token-file", type=Path, default=None, metavar="FILE",
                        help=f"read the bearer token {purpose} from FILE (first line); keep it 0600")
    tokens.add_argument("--admin-token", default=None,
                        help=f"bearer token {purpose} (default: ${ADMIN_TOKEN_ENV}); visible to other users "
                             "of this machine in `ps` output: prefer --admin-token-file or the variable")


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    path = getattr(args, "admin_token_file", None)
    if path is not None:
        return read_token_file(path)
    return getattr(args, "admin_token", None) or environ.get(ADMIN_TOKEN_ENV) or None


def read_token_file(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--admin-token-file: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise UsageError(f"--admin-token-file: {path} is empty")
    return token
