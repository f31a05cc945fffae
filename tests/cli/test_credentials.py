"""Credentials: `moespec tune` talks TLS to a TLS server (--tls-ca, --tls-server-name), the admin token
comes from a file (--admin-token-file) as well as the flag and the variable, and `--help` warns that the
flag is visible in `ps`. Real `moespec tune` / `moespec client` processes against a real TLS server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.server.server import ServerConfig
from tests.conftest import ServerThread
from tests.support.tls_helpers import self_signed

TOKEN = "file-token-7f3a"
CERT_NAME = "moespec.internal"  # not the address the tests dial: the server name override is needed


def moespec(*argv: str, cwd=None, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MOESPEC_ADMIN_TOKEN"} | (env or {})
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=environ)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"), CERT_NAME)


@pytest.fixture(scope="module")
def tls_server(backend, tls):
    cert, key = tls
    s = ServerThread(backend, ServerConfig(port=0, admin_token=TOKEN, tls_cert=cert.read_bytes(),
                                           tls_key=key.read_bytes()))
    yield s
    s.stop()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def tune(server, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """One trial whose window starves at once: exit 5 (no traffic) means the tuner reached the server,
    read its model info and had its SetPolicy accepted; 3 means it never connected, 4 token refused."""
    return moespec("tune", "--server", server.address, "--otlp-listen", "127.0.0.1:0",
                   "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--trials", "1", "--max-window-seconds", "1",
                   "--max-failures", "1", "--connect-timeout", "3", "--trial-mode", "sequential", *extra,
                   cwd=tmp_path)


def test_tune_talks_tls_with_a_ca_and_a_server_name(tls_server, tls, token_file, tmp_path):
    cert, _ = tls
    result = tune(tls_server, tmp_path, "--tls-ca", str(cert), "--tls-server-name", CERT_NAME,
                  "--admin-token-file", str(token_file))
    assert result.returncode == 5, result.stderr  # connected, authorised, then no traffic
    assert "no traffic" in result.stderr or "starved" in result.stderr


def test_tune_without_the_ca_cannot_reach_a_tls_server(tls_server, token_file, tmp_path):
    result = tune(tls_server, tmp_path, "--admin-token-file", str(token_file))
    assert result.returncode == 3, result.stderr


def test_tune_with_a_wrong_token_file_is_refused(tls_server, tls, tmp_path):
    cert, _ = tls
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    result = tune(tls_server, tmp_path, "--tls-ca", str(cert), "--tls-server-name", CERT_NAME,
                  "--admin-token-file", str(wrong))
    assert result.returncode == 4, result.stderr


def test_client_reads_the_token_file_over_tls(tls_server, tls, token_file):
    cert, _ = tls
    common = ("--server", tls_server.address, "--tls-ca", str(cert), "--tls-server-name", CERT_NAME)
    ok = moespec("client", "policy", "get", *common, "--admin-token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    refused = moespec("client", "policy", "get", *common)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


@pytest.mark.parametrize("command", ["serve", "tune"])
def test_help_says_the_token_flag_is_visible_in_ps(command):
    result = moespec(command, "--help")
    text = " ".join(result.stdout.split())
    assert "--admin-token-file" in text and "visible to other users" in text and "`ps`" in text


@pytest.mark.parametrize("command", [("serve", "--port", "0"), ("tune", "--server", "127.0.0.1:1")])
def test_an_empty_or_missing_token_file_exits_2(command, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    result = moespec(*command, "--admin-token-file", str(empty), cwd=tmp_path)
    assert result.returncode == 2 and "--admin-token-file" in result.stderr and "empty" in result.stderr
    result = moespec(*command, "--admin-token-file", str(tmp_path / "missing"), cwd=tmp_path)
    assert result.returncode == 2 and "cannot read" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_takes_its_token_from_the_file(token_file):
    from service.cli import build_parser
    from service.cli.serve import server_config

    argv = ["serve", "--admin-token-file", str(token_file)]
    config = server_config(build_parser(argv).parse_args(argv), {"MOESPEC_ADMIN_TOKEN": "from-env"})
    assert config.admin_token == TOKEN  # the file wins over the variable
    argv = ["serve"]
    assert server_config(build_parser(argv).parse_args(argv), {"MOESPEC_ADMIN_TOKEN": "from-env"}).admin_token \
        == "from-env"
