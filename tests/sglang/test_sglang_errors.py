"""The SGLang backend refuses to start with one clear line: bad model paths first (before SGLang is
touched), then a missing sglang install, then a missing CUDA GPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import types

import pytest
import torch

from service.errors import UsageError
from service.sglang_backend import add_arguments, create_backend
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend.preflight import SGLangUnavailable, import_sglang, require_cuda

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def model_dir(path, **config):
    path.mkdir(parents=True)
    base = {"model_type": "qwen2_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "hidden_size": 32, "moe_intermediate_size": 16, "vocab_size": 64, "max_position_embeddings": 128}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def sglang_must_not_be_imported(monkeypatch):
    def fail():
        raise AssertionError("sglang was imported before the arguments were checked")

    monkeypatch.setattr(sglang_cli, "import_sglang", fail)


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed here; the missing-package path cannot run")
def test_missing_sglang_names_the_extra_to_install():
    with pytest.raises(SGLangUnavailable) as e:
        import_sglang()
    assert "pip install '.[sglang]'" in str(e.value) and "0.5.23" in str(e.value)
    assert isinstance(e.value.__cause__, ImportError)  # the real import failed, not a guess


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed here")
def test_create_backend_without_sglang_is_a_usage_error(tmp_path):
    args = parse("--model-path", model_dir(tmp_path / "t"), "--speculative-algorithm", "NGRAM")
    with pytest.raises(UsageError, match=r"pip install"):
        create_backend(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_no_cuda_gpu_says_so_and_points_at_the_torch_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_cli, "import_sglang", lambda: types.SimpleNamespace(__version__="0.5.23"))
    with pytest.raises(SGLangUnavailable, match=r"CUDA GPU.*--backend torch"):
        require_cuda()
    args = parse("--model-path", model_dir(tmp_path / "t"), "--speculative-algorithm", "NGRAM")
    with pytest.raises(SGLangUnavailable, match="CUDA"):
        create_backend(args)


@pytest.mark.usefixtures("sglang_must_not_be_imported")
@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no config.json"),
    (lambda p: model_dir(p / "dense", num_experts=0), "no routed experts"),
    (lambda p: model_dir(p / "wide", num_experts_per_tok=10), "holds 8 ids per token"),
])
def test_bad_model_paths_are_refused_before_sglang_starts(tmp_path, setup, message):
    with pytest.raises(UsageError, match=message) as e:
        create_backend(parse("--model-path", setup(tmp_path)))
    assert str(e.value).startswith("--model-path")


@pytest.mark.usefixtures("sglang_must_not_be_imported")
def test_weightless_directory_is_refused(tmp_path):
    path = model_dir(tmp_path / "t")
    (path / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="no \\*.safetensors"):
        create_backend(parse("--model-path", path))


@pytest.mark.usefixtures("sglang_must_not_be_imported")
def test_model_path_is_required():
    with pytest.raises(UsageError, match="needs --model-path"):
        create_backend(parse())


@pytest.mark.usefixtures("sglang_must_not_be_imported")
def test_standalone_without_a_draft_and_a_bad_draft_path_are_refused(tmp_path):
    target = model_dir(tmp_path / "t")
    with pytest.raises(UsageError, match="STANDALONE needs --draft-model-path"):
        create_backend(parse("--model-path", target, "--speculative-algorithm", "STANDALONE"))
    with pytest.raises(UsageError, match="^--draft-model-path .*no such directory"):
        create_backend(parse("--model-path", target, "--draft-model-path", tmp_path / "nope"))


@pytest.mark.usefixtures("sglang_must_not_be_imported")
def test_a_tree_ranking_temperature_needs_eagle_and_a_sane_value(tmp_path):
    target = model_dir(tmp_path / "t")
    with pytest.raises(UsageError, match="--sglang-tree-temperature ranks draft trees, which only"):
        create_backend(parse("--model-path", target, "--sglang-tree-temperature", "0.2"))  # NGRAM
    with pytest.raises(UsageError, match=r"--sglang-tree-temperature must be in \[0.01, 100\], got 0$"):
        create_backend(parse("--model-path", target, "--speculative-algorithm", "EAGLE3",
                             "--sglang-tree-temperature", "0"))
    with pytest.raises(UsageError, match="wants auto or a number, got 'cold'"):
        create_backend(parse("--model-path", target, "--speculative-algorithm", "EAGLE3",
                             "--sglang-tree-temperature", "cold"))


def test_auto_ranks_trees_at_what_the_draft_directory_records(tmp_path):
    from service.engine.model.weights import MODELS_DIR

    shipped = MODELS_DIR / "eagle3"
    assert sglang_cli.tree_temperature_from_flag("auto", "EAGLE3", shipped) == 0.15  # its recorded fit
    assert sglang_cli.tree_temperature_from_flag("auto", "STANDALONE", shipped) == 1.0  # chains: nothing to rank
    assert sglang_cli.tree_temperature_from_flag("auto", "EAGLE3", tmp_path) == 1.0  # no record: SGLang's ranking
    assert sglang_cli.tree_temperature_from_flag("0.3", "EAGLE3", shipped) == 0.3  # a number overrides it
    (tmp_path / sglang_cli.TREE_RANKING_FILE).write_text('{"temperature": 0.2}')
    with pytest.raises(UsageError, match="tree_ranking.json: not a tree ranking record"):
        sglang_cli.tree_temperature_from_flag("auto", "EAGLE", tmp_path)


def test_importing_the_backend_package_and_adapter_imports_no_sglang():
    import subprocess
    import sys

    code = ("import sys, service.sglang_backend, service.sglang_backend.adapter; "
            "sys.exit(1 if 'sglang' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_moespec_serve_exits_2_with_one_line(tmp_path, capsys):
    from service.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "sglang", "--model-path", str(tmp_path / "missing")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model-path" in err and "no such directory" in err


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed here")
def test_moespec_serve_without_sglang_names_the_extra(tmp_path, capsys):
    from service.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "sglang", "--model-path", str(model_dir(tmp_path / "t")),
              "--speculative-algorithm", "NGRAM"])
    assert e.value.code == 2 and "pip install '.[sglang]'" in capsys.readouterr().err
