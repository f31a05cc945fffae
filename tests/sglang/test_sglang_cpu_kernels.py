"""`moespec serve --backend sglang --device cpu` where SGLang is installed but its CPU kernel ops
(sgl_kernel) are not, as with every published SGLang: one line, exit 2, pointing at the torch
backend, instead of a traceback from SGLang's start-up. With the ops importable (the test
stand-ins on sys.path) the check lets the start go on."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from service.cli import main
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend.preflight import CPU_KERNELS, SGLangUnavailable, require_cpu_kernels
from tests.sglang.test_sglang_errors import model_dir

STAND_INS = Path(__file__).resolve().parents[1] / "sglang_cpu" / "site"
KERNELS_HERE = importlib.util.find_spec(CPU_KERNELS) is not None


@pytest.mark.skipif(KERNELS_HERE, reason="sgl_kernel is importable here")
def test_serve_on_cpu_without_the_kernel_ops_exits_2_with_one_line_naming_the_torch_backend(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sglang_cli, "import_sglang", lambda: types.SimpleNamespace(__version__="0.5.23"))
    for name in ("SGLANG_USE_CPU_ENGINE", "TORCHDYNAMO_DISABLE"):  # serve sets SGLang's CPU switch:
        monkeypatch.setenv(name, "")  # registered with monkeypatch, so it is undone after the test
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "sglang", "--device", "cpu", "--model-path", str(model_dir(tmp_path / "t")),
              "--speculative-algorithm", "NGRAM"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.count("\n") == 0 and err.startswith("moespec serve: error:")
    assert "sgl_kernel" in err and "--backend torch" in err


@pytest.mark.skipif(KERNELS_HERE, reason="sgl_kernel is importable here")
def test_the_check_refuses_a_missing_module_and_accepts_the_stand_ins(monkeypatch):
    with pytest.raises(SGLangUnavailable, match="--backend torch"):
        require_cpu_kernels()
    monkeypatch.syspath_prepend(str(STAND_INS))
    importlib.invalidate_caches()
    require_cpu_kernels()  # found, not imported
    assert CPU_KERNELS not in sys.modules
