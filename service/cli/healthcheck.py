"""`moespec healthcheck`: the container health check, following the running server's own flags.

A Docker HEALTHCHECK line is fixed in the image while `moespec serve`'s --port, --host and --tls-cert
come from the container's command. So this command reads the server process's command line
(/proc/PID/cmdline: PID 1 in a container, else the only `moespec serve` of this user), parses it
with `moespec serve`'s own parser, and asks the standard grpc.health.v1 service where that server
really listens: plaintext, or TLS when it was started with --tls-cert.

TLS: the certificate is verified against --tls-ca (default $MOESPEC_HEALTHCHECK_TLS_CA, else the
server's own --tls-cert file, which is enough for a self-signed certificate) for the name
--tls-server-name (default $MOESPEC_HEALTHCHECK_TLS_SERVER_NAME, else "localhost").

Exit codes: 0 SERVING; 1 anything else (NOT_SERVING while draining, no answer, not a moespec server,
no such process); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.errors import UsageError

TLS_CA_ENV = "MOESPEC_HEALTHCHECK_TLS_CA"
TLS_SERVER_NAME_ENV = "MOESPEC_HEALTHCHECK_TLS_SERVER_NAME"
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True)
class Target:
    address: str  # HOST:PORT to dial
    tls_cert: Path | None  # the server's certificate chain (TLS) or None (plaintext)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[1].replace("\n", " ")
    parser.add_argument("--pid", type=int, default=None,
                        help="process id of the `moespec serve` to check (default: PID 1, the container's server, "
                             "or else the only `moespec serve` of this user, e.g. under docker run --init)")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for the answer (default 4)")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help=f"CA to verify a TLS server with (default ${TLS_CA_ENV}, else its own --tls-cert)")
    parser.add_argument("--tls-server-name", default=None,
                        help=f"name its certificate must carry (default ${TLS_SERVER_NAME_ENV}, else localhost)")


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    try:
        pid = args.pid if args.pid is not None else find_server_pid()
        target = target_of(serve_argv(pid), Path(f"/proc/{pid}/cwd"))
    except (OSError, LookupError) as e:
        print(f"moespec healthcheck: {e}", file=sys.stderr)
        return 1
    return check(target, args, os.environ)


def find_server_pid() -> int:
    """PID 1 when it is the server (a container's entrypoint), else the one `moespec serve` process
    of this user (an init process such as tini sits at PID 1 with the server as its child)."""
    try:
        serve_argv(1)
        return 1
    except (OSError, LookupError):
        pass
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and _is_moespec_serve(serve_argv_raw(int(entry.name))):
                found.append(int(entry.name))
        except (OSError, LookupError):
            continue
    if len(found) != 1:
        raise LookupError(f"found {len(found)} `moespec serve` processes of this user; give --pid")
    return found[0]


def serve_argv_raw(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode("utf-8", errors="replace") for a in raw.split(b"\0") if a]


def _is_moespec_serve(argv: list[str]) -> bool:
    return "serve" in argv and any("moespec" in a or "service.cli" in a for a in argv[:argv.index("serve")])


def serve_argv(pid: int) -> list[str]:
    """The arguments after `serve` on process `pid`'s command line."""
    argv = serve_argv_raw(pid)
    if not _is_moespec_serve(argv):
        raise LookupError(f"process {pid} is not `moespec serve`: {' '.join(argv)[:200]}")
    return argv[argv.index("serve") + 1:]


def target_of(serve_args: list[str], cwd: Path) -> Target:
    """Where a server started with these arguments listens, as its own parser reads them."""
    from service.cli import build_parser

    parser = build_parser(["serve"])
    args, _ = parser.parse_known_args(["serve", *serve_args])
    host = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host
    if args.host in ("::", "[::]"):
        host = "[::1]"
    cert = args.tls_cert if args.tls_cert and args.tls_key else None
    if cert is not None and not cert.is_absolute():
        cert = cwd / cert  # relative to where the server runs, not to this process
    return Target(f"{host}:{args.port}", cert)


def check(target: Target, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    import grpc

    from service.server.client import MoespecClient

    tls_ca = server_name = None
    if target.tls_cert is not None:
        tls_ca = args.tls_ca or (Path(environ[TLS_CA_ENV]) if environ.get(TLS_CA_ENV) else target.tls_cert)
        server_name = args.tls_server_name or environ.get(TLS_SERVER_NAME_ENV) or "localhost"
    try:
        client = MoespecClient(target.address, tls_ca=tls_ca, tls_server_name=server_name)
    except OSError as e:
        print(f"moespec healthcheck: cannot read the TLS CA {tls_ca}: {e.strerror}", file=sys.stderr)
        return 1
    with client:
        try:
            status = client.health(timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"moespec healthcheck: {target.address}: {e.code().name}", file=sys.stderr)
            return 1
    scheme = "tls" if tls_ca else "plaintext"
    print(f"{status} ({target.address}, {scheme})")
    return 0 if status == "SERVING" else 1
