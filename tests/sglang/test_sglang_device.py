"""`moespec serve --backend sglang --device cpu`: SGLang's CPU mode is switched on before sglang is
imported, the CPU engine settings reach sglang.Engine (the operator's own flags win), no CUDA
check runs, and the device is reported in ModelInfo. The real CPU run is tests/sglang/test_sglang_cpu.py."""

from __future__ import annotations

import os
import types

import pytest

from service.server import convert
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend.backend import RECORDER_DIR_ENV
from tests.sglang.fake_sglang import FakeEngine
from tests.sglang.test_sglang_backend import make_backend


@pytest.fixture
def cpu_journal(monkeypatch):
    """Engines the backend starts; the import records the environment SGLang would have seen."""
    engines: list[FakeEngine] = []
    seen_env: dict[str, str | None] = {}

    def import_sglang():
        seen_env.update({k: os.environ.get(k) for k in ("SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE")})
        return types.SimpleNamespace(__version__="0.5.23", Engine=lambda **kw: FakeEngine(engines, **kw))

    def no_cuda_check():
        raise AssertionError("--device cpu must not check for CUDA")

    monkeypatch.setattr(sglang_cli, "import_sglang", import_sglang)
    monkeypatch.setattr(sglang_cli, "require_cuda", no_cuda_check)
    monkeypatch.setattr(sglang_cli, "require_cpu_kernels", lambda: None)  # the fake SGLang has its CPU ops
    monkeypatch.setattr(sglang_cli, "check_plugin_hooks", lambda: None)  # and the hook points
    for name in ("SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(RECORDER_DIR_ENV, "unset-by-test")
    yield types.SimpleNamespace(engines=engines, seen_env=seen_env)
    for name in ("SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE"):  # set by the backend, not by monkeypatch
        os.environ.pop(name, None)


def test_device_cpu_switches_sglangs_cpu_mode_on_before_the_import(tmp_path, cpu_journal):
    backend = make_backend(tmp_path, "--device", "cpu")
    try:
        assert cpu_journal.seen_env == {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1"}
        kwargs = cpu_journal.engines[-1].kwargs
        assert kwargs["device"] == "cpu" and kwargs["attention_backend"] == "intel_amx"
        assert kwargs["disable_decode_cuda_graph"] and kwargs["disable_prefill_cuda_graph"]
        assert (kwargs["mem_fraction_static"], kwargs["max_total_tokens"], kwargs["chunked_prefill_size"]) == (
            0.3, 4096, 256)
        assert backend.info.device == "cpu"
        assert convert.info_from_pb(convert.info_to_pb(backend.info)).device == "cpu"
    finally:
        backend.close()


def test_the_operators_flags_override_the_cpu_defaults(tmp_path, cpu_journal):
    backend = make_backend(tmp_path, "--device", "cpu", "--sglang-mem-fraction", "0.2",
                           "--sglang-chunked-prefill", "128", "--sglang-arg", "attention_backend=torch_native")
    try:
        kwargs = cpu_journal.engines[-1].kwargs
        assert (kwargs["mem_fraction_static"], kwargs["chunked_prefill_size"], kwargs["attention_backend"]) == (
            0.2, 128, "torch_native")
    finally:
        backend.close()


def test_the_default_device_is_cuda_and_adds_no_cpu_settings(tmp_path, cpu_journal, monkeypatch):
    checked = []
    monkeypatch.setattr(sglang_cli, "require_cuda", lambda: checked.append(True))
    backend = make_backend(tmp_path)
    try:
        assert checked == [True] and cpu_journal.seen_env["SGLANG_USE_CPU_ENGINE"] is None
        kwargs = cpu_journal.engines[-1].kwargs
        assert "device" not in kwargs and kwargs["chunked_prefill_size"] == 4096
        assert backend.info.device == "cuda"
    finally:
        backend.close()
