"""Run `moespec serve` as a child process on port 0, with telemetry aimed at a given OTLP endpoint.

Used by the demo, the benchmark and the tests. The child's environment is built explicitly from the
arguments (on top of the caller's, which it inherits) so nothing depends on the caller having
exported OTEL_* variables. `moespec serve` prints "moespec serving on HOST:PORT" once ready.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"moespec serving on (\S+:\d+)")
# `python -m service.cli` would import service.cli twice (as __main__ and as a module), and a
# UsageError raised by a subcommand would then escape main(); calling main() avoids that.
MOESPEC = (sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())")
REPO_ROOT = Path(__file__).resolve().parents[2]


def telemetry_env(otlp_endpoint: str, schedule_delay_ms: int = 200, service_name: str = "moespec") -> dict[str, str]:
    """OTEL_* for a server whose request spans feed a tuner: traces only, exported every ~200 ms
    (the SDK's 5 s batch delay would stretch every trial window by 5 s)."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": str(schedule_delay_ms),
        "OTEL_SERVICE_NAME": service_name,
    }


def stop_process(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it has not exited within `timeout`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


@dataclass
class ServerProcess:
    """A started server; `address` is HOST:PORT. Use as a context manager or call `stop()`."""

    process: subprocess.Popen
    address: str
    output: deque = field(default_factory=lambda: deque(maxlen=200))

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.process, timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self) -> str:
        return "".join(self.output)


def start_server(
    env: Mapping[str, str],
    admin_token: str,
    extra_args: tuple[str, ...] = (),
    port: int = 0,
    ready_timeout: float = 120.0,
    cwd: Path = REPO_ROOT,
) -> ServerProcess:
    """Start `moespec serve` and wait for its ready line (RuntimeError with its output otherwise)."""
    child_env = {**os.environ, **env, "MOESPEC_ADMIN_TOKEN": admin_token}
    proc = subprocess.Popen(
        [*MOESPEC, "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args],
        env=child_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )
    output: deque = deque(maxlen=200)
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        # Keep draining the pipe for the server's whole life, or it would block on a full pipe.
        for line in proc.stdout:
            output.append(line)
            if not found and (m := READY.search(line)):
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True, name="server-output").start()
    deadline = time.monotonic() + ready_timeout
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            break
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"moespec serve did not become ready (exit {proc.returncode}):\n{''.join(output)}")
    return ServerProcess(proc, found[0], output)
