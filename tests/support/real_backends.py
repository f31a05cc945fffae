"""Real observability backends as child processes on loopback, for the tests that check moespec's
telemetry against them (Prometheus from the Debian package, Arize Phoenix from its own venv).

Each backend gets free ports, a working directory under the test's tmp_path, readiness polled with
a bounded timeout, and is stopped (SIGTERM, then SIGKILL) however the test ends. A backend that is
not installed skips its tests, unless MOESPEC_REQUIRE_BACKENDS=1 (set by scripts/test.sh, which
installs both) turns the skip into a failure, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tuner.drivers.server_proc import stop_process

REQUIRE_ENV = "MOESPEC_REQUIRE_BACKENDS"
PHOENIX_VENV_ENV = "MOESPEC_PHOENIX_VENV"


def missing(what: str, how: str) -> None:
    """Skip (or fail, when the backends are required) because `what` is not installed."""
    message = f"{what} is not installed ({how})"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires it")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, params: Mapping[str, str] | None = None, timeout: float = 10.0):
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return json.loads(reply.read().decode())
    except urllib.error.HTTPError as e:  # say what the backend objected to
        raise AssertionError(f"{e.code} from {url}: {e.read().decode(errors='replace')[:2000]}") from None


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll until `predicate()` is truthy (exceptions count as not yet) -> its value; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # not up yet: connection refused, 503, half-written answer
            last_error = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout:.0f} s (last error: {last_error!r})")
        time.sleep(interval)


@dataclass
class Backend:
    """A started backend process; its output goes to `log` (shown when readiness fails)."""

    name: str
    process: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.process, timeout)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def wait_ready(self, url: str, timeout: float) -> None:
        def up() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status == 200

        try:
            wait_until(up, timeout, what=f"{self.name} ready at {url}")
        except (TimeoutError, RuntimeError) as e:
            self.stop()
            raise RuntimeError(f"{e}\n--- {self.name} log ---\n{self.log_tail()}") from None


def start(name: str, argv: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None) -> Backend:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(list(argv), cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=dict(env) if env is not None else None)
    return Backend(name, process, log)


# ------------------------------------------------------------------ Prometheus
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        missing("prometheus", "apt-get install prometheus; scripts/setup_venv.sh test does it")
    return path


def start_prometheus(workdir: Path, targets: Sequence[str], scrape_interval: str = "1s") -> tuple[Backend, str]:
    """Prometheus scraping `targets` (HOST:PORT, path /metrics) -> (backend, base URL)."""
    binary = prometheus_binary()
    port = free_port()
    config = workdir / "prometheus.yml"
    workdir.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({  # JSON is YAML: no YAML writer needed
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": "moespec", "static_configs": [{"targets": list(targets)}]}],
    }))
    backend = start("prometheus", [
        binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ], workdir)
    url = f"http://127.0.0.1:{port}"
    backend.wait_ready(f"{url}/-/ready", timeout=60)
    return backend, url


# ------------------------------------------------------------------ Phoenix
def phoenix_python() -> Path:
    venv = Path(os.environ.get(PHOENIX_VENV_ENV) or Path.home() / ".cache/moespec/phoenix-venv")
    python = venv / "bin/python"
    if not python.exists():
        missing("Arize Phoenix", f"no venv at {venv}; run scripts/setup_phoenix.sh")
    return python


def start_phoenix(workdir: Path) -> tuple[Backend, str, str]:
    """Phoenix with its data in `workdir`, loopback only, no usage telemetry and no external resources
    -> (backend, HTTP base URL, OTLP/gRPC endpoint)."""
    python = phoenix_python()
    http_port, grpc_port = free_port(), free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir),
        "PHOENIX_WORKING_DIR": str(workdir), "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http_port), "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_TELEMETRY_ENABLED": "false", "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    backend = start("phoenix", [str(python), "-m", "phoenix.server.main", "serve"], workdir, env)
    url = f"http://127.0.0.1:{http_port}"
    backend.wait_ready(f"{url}/healthz", timeout=300)  # ~40 s on two busy cores: migrations, UI bundle
    return backend, url, f"http://127.0.0.1:{grpc_port}"
