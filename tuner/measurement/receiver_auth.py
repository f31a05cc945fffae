"""Who the tuner believes: the authentication and TLS options of its OTLP span receiver.

Every span that reaches the receiver moves a trial's value, so the receiver is a trust boundary:
- `--otlp-token-file FILE` or $MOESPEC_OTLP_TOKEN: every export must carry
  `authorization: Bearer <token>` (a Collector's exporter `headers:`; a moespec server's
  OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>); others get UNAUTHENTICATED.
- `--otlp-tls-cert` / `--otlp-tls-key`: the receiver serves TLS only.
- Listening on anything but a loopback address without a token is refused (exit 2): on a shared
  network anyone could choose the winning policy.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.errors import UsageError

OTLP_TOKEN_ENV = "MOESPEC_OTLP_TOKEN"


@dataclass(frozen=True)
class IntakeSecurity:
    bearer_token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("span intake (who may send the tuner spans)")
    group.add_argument("--otlp-token-file", type=Path, default=None, metavar="FILE",
                       help=f"require 'authorization: Bearer <token>' on every OTLP export, the token read from "
                            f"FILE (first line; default ${OTLP_TOKEN_ENV}); needed to listen beyond loopback")
    group.add_argument("--otlp-tls-cert", type=Path, default=None, metavar="PEM",
                       help="serve the OTLP receiver over TLS with this certificate chain (with --otlp-tls-key)")
    group.add_argument("--otlp-tls-key", type=Path, default=None, metavar="PEM", help="private key for --otlp-tls-cert")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def intake_security(args: argparse.Namespace, environ: Mapping[str, str], listen_host: str) -> IntakeSecurity:
    token = _read_first_line(args.otlp_token_file, "--otlp-token-file") if args.otlp_token_file else None
    token = token or environ.get(OTLP_TOKEN_ENV) or None
    if bool(args.otlp_tls_cert) != bool(args.otlp_tls_key):
        raise UsageError("--otlp-tls-cert and --otlp-tls-key go together")
    if token is None and not is_loopback(listen_host):
        raise UsageError(f"--otlp-listen {listen_host} reaches beyond this machine: give --otlp-token-file or "
                         f"${OTLP_TOKEN_ENV} (and send it from the Collector's exporter headers), or listen on "
                         "127.0.0.1")
    return IntakeSecurity(token, _read(args.otlp_tls_cert, "--otlp-tls-cert"),
                          _read(args.otlp_tls_key, "--otlp-tls-key"))


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _read_first_line(path: Path, flag: str) -> str:
    lines = (_read(path, flag) or b"").decode("utf-8", errors="replace").strip().splitlines()
    if not lines or not lines[0].strip():
        raise UsageError(f"{flag}: {path} is empty")
    return lines[0].strip()
