"""`moespec healthcheck` (the image's HEALTHCHECK) follows the server's own --port and --tls-cert: run
against real `moespec serve` processes on a non-default port, plaintext and TLS (certificate paths
relative to the server's folder), and through the exact command the Dockerfile's HEALTHCHECK line runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tls_helpers import self_signed
from tuner.drivers.server_proc import start_server

REPO = Path(__file__).resolve().parents[2]
FAST_START = ("--threads", "1", "--kernel-threads", "1", "--max-batch", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moespec(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def dockerfile_healthcheck() -> list[str]:
    """The exec-form command of the Dockerfile's HEALTHCHECK line."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])\s*$", text, re.MULTILINE)
    assert match, "no exec-form HEALTHCHECK in the Dockerfile"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def plain_server():
    port = free_port()
    with start_server({}, "t", (*FAST_START,), port=port) as server:
        yield server, port


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls-server")
    self_signed(folder, "localhost", ip="127.0.0.1")
    port = free_port()
    # Relative paths: the health check must resolve them against the server's folder, not its own.
    with start_server({}, "t", (*FAST_START, "--tls-cert", "cert.pem", "--tls-key", "key.pem"), port=port,
                      cwd=folder) as server:
        yield server, port, folder


def test_healthcheck_finds_a_plaintext_server_on_its_own_port(plain_server):
    server, port = plain_server
    assert port != 50051
    result = moespec("healthcheck", "--pid", str(server.process.pid))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"SERVING (127.0.0.1:{port}, plaintext)"


def test_healthcheck_speaks_tls_to_a_tls_server(tls_server):
    server, port, _ = tls_server
    result = moespec("healthcheck", "--pid", str(server.process.pid))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"SERVING (127.0.0.1:{port}, tls)"
    # The negative control: a plaintext health check at the right port fails against it.
    assert moespec("client", "health", "--server", f"127.0.0.1:{port}", "--timeout", "3").returncode == 1


def test_healthcheck_verifies_the_certificate_name(tls_server):
    server, _, _ = tls_server
    result = moespec("healthcheck", "--pid", str(server.process.pid), "--tls-server-name", "not-this-server")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    result = moespec("healthcheck", "--pid", str(server.process.pid),
                     env={"MOESPEC_HEALTHCHECK_TLS_SERVER_NAME": "not-this-server"})
    assert result.returncode == 1


def test_the_dockerfiles_healthcheck_command_checks_the_running_server(plain_server, tls_server):
    command = dockerfile_healthcheck()
    assert command[:2] == ["moespec", "healthcheck"]
    for server in (plain_server[0], tls_server[0]):
        result = moespec(*command[1:], "--pid", str(server.process.pid))  # in a container: PID 1
        assert result.returncode == 0 and result.stdout.startswith("SERVING"), result.stderr


def test_healthcheck_fails_for_a_process_that_is_not_a_server():
    result = moespec("healthcheck", "--pid", str(os.getpid()))
    assert result.returncode == 1 and "not `moespec serve`" in result.stderr


def test_healthcheck_fails_once_the_server_is_gone(tmp_path):
    port = free_port()
    server = start_server({}, "t", FAST_START, port=port)
    pid = server.process.pid
    assert moespec("healthcheck", "--pid", str(pid)).returncode == 0
    server.stop()
    result = moespec("healthcheck", "--pid", str(pid))
    assert result.returncode == 1 and "Traceback" not in result.stderr


def test_without_a_pid_it_finds_the_server_under_an_init_process(tmp_path):
    """`docker run --init` puts an init process at PID 1 and the server below it: the health check finds
    the only `moespec serve` instead. Run in a fresh PID namespace (unshare), where a shell is PID 1."""
    if shutil.which("unshare") is None or os.getuid() != 0:
        pytest.skip("needs unshare and root for a private PID namespace")
    port, log = free_port(), tmp_path / "serve.log"
    serve = " ".join([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                      *FAST_START])
    script = (f"{serve} > {log} 2>&1 & "
              f"for i in $(seq 1 240); do grep -q 'moespec serving on' {log} && break; sleep 0.5; done; "
              f"{sys.executable} -m service.cli healthcheck; echo rc=$?; kill %1; wait")
    result = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
                            capture_output=True, text=True, timeout=180, env=os.environ.copy())
    assert f"SERVING (127.0.0.1:{port}, plaintext)" in result.stdout, result.stdout + result.stderr + log.read_text()
    assert "rc=0" in result.stdout
