"""The server mode of `moespec bench llamacpp`: llama.cpp's `llama-server` and `moespec serve`, each
at its own defaults (same thread count), under the same concurrent load.

Each side serves `concurrency` clients that send their requests at once: `concurrency` prompts of
exactly `depth` tokens (the same token ids on both sides), `tokens` new tokens each, greedy. The
figure is what a client fleet gets: generated tokens over the wall time from the first request sent
to the last answer received (prefill, queueing and transport included).

- llama.cpp: `llama-server` with `concurrency` parallel slots (`-np`) and its default continuous
  batching, one context big enough for every slot; requests to its `/completion` endpoint with
  `cache_prompt: false` (every round sends the same prompts: a slot's cached prefix would skip the
  prefill that the moespec side pays) and `ignore_eos` (every request generates `tokens`).
- moespec: `moespec serve` with its default flags but `--kernel-threads` (llama.cpp's `-t`) and a
  queue that holds the load; unary `Generate` calls over gRPC (loopback, no TLS) with
  `prompt_token_ids`. Both sides count the tokens each answer reports.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from service.bench.server import stop_child
from service.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(Exception):
    """llama-server exited at start or never answered its /health."""


class LlamaServer:
    """`llama-server` as a child process; entering waits for its /health, leaving stops it."""

    def __init__(self, binary: Path, model: Path, threads: int, slots: int, context_per_slot: int,
                 ready_timeout: float = 120.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                     "-c", str(slots * context_per_slot), "--host", "127.0.0.1", "--port", str(self.port),
                     "--no-webui"]
        self._ready_timeout = ready_timeout

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self._cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"llama-server exited {self.proc.returncode} at start: {' '.join(self._cmd)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # loading the model: 503, or not listening yet
            time.sleep(0.2)
        self.__exit__()
        raise ServerFailed(f"llama-server not ready in {self._ready_timeout:.0f} s: {' '.join(self._cmd)}")

    def __exit__(self, *exc) -> None:
        stop_child(self.proc)

    def complete(self, ids: tuple[int, ...], tokens: int) -> int:
        """One greedy completion of exactly `tokens` tokens -> tokens it reports generated."""
        body = json.dumps({"prompt": list(ids), "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(f"{self.url}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
        return int(answer["tokens_predicted"])


def concurrent_load(send, prompts: list[tuple[int, ...]], tokens: int) -> float:
    """Every prompt sent at once by its own client -> generated tokens / wall seconds."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        start = time.perf_counter()
        generated = sum(pool.map(lambda ids: send(ids, tokens), prompts))
        return generated / (time.perf_counter() - start)


def moespec_send(client):
    """A `send(ids, tokens)` for concurrent_load over a MoespecClient."""
    def send(ids: tuple[int, ...], tokens: int) -> int:
        return client.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=tokens,
                                                 sampling=GREEDY)).completion_tokens
    return send
