"""`moespec client` against a real server, and `moespec serve`'s argument errors (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from service.cli import main
from service.server.server import ServerConfig
from tests.conftest import ADMIN_TOKEN, RecordingBackend, ServerThread


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse and UsageError exit this way
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_client_generate_prints_the_text_and_a_summary(server, capsys):
    code, out, err = run_cli(capsys, "client", "generate", "--server", server.address, "--prompt", "x =",
                             "--max-new-tokens", "4", "--seed", "1")
    assert code == 0 and out.strip() and "policy default" in err


def test_client_generate_stream_prints_the_same_text_as_unary(server, capsys):
    args = ["client", "generate", "--server", server.address, "--prompt", "x =", "--max-new-tokens", "6",
            "--seed", "3", "--json"]
    _, unary, _ = run_cli(capsys, *args)
    _, streamed, _ = run_cli(capsys, *args, "--stream")
    assert json.loads(unary)["text"] == json.loads(streamed)["text"]


def test_client_policy_set_then_get_with_the_token(server, capsys, default_policy):
    code, out, _ = run_cli(capsys, "client", "policy", "set", "--server", server.address, "--admin-token",
                           ADMIN_TOKEN, "--drafter", "ngram", "--draft-length", "2", "--policy-id", "cli")
    assert code == 0 and json.loads(out)["policy_id"] == "cli"
    code, out, _ = run_cli(capsys, "client", "policy", "get", "--server", server.address, "--admin-token", ADMIN_TOKEN)
    assert code == 0 and json.loads(out) == {"drafter": "ngram", "draft_length": 2, "draft_temperature": 1.0,
                                             "policy_id": "cli", "controller": "static", "cost_weight": 1.0,
                                             "cells": [], "tree_width": 1}


def test_client_policy_set_takes_a_controller(server, capsys, default_policy):
    code, out, _ = run_cli(capsys, "client", "policy", "set", "--server", server.address, "--admin-token",
                           ADMIN_TOKEN, "--drafter", "ngram", "--draft-length", "8", "--controller", "moespec",
                           "--cost-weight", "2", "--cell", "b1-1.sampled=plain")
    assert code == 0
    plain_cell = {"policy": {"drafter": "model", "draft_length": 0, "draft_temperature": 1.0, "policy_id": "",
                             "controller": "static", "cost_weight": 1.0, "cells": [], "tree_width": 1},
                  "min_batch": 1, "max_batch": 1, "kind": "sampled"}
    assert json.loads(out) == {"drafter": "ngram", "draft_length": 8, "draft_temperature": 1.0,
                               "policy_id": "moespec-ngram-k8-w2+b1-1.sampled=plain", "controller": "moespec",
                               "cost_weight": 2.0, "cells": [plain_cell], "tree_width": 1}


@pytest.fixture(scope="module")
def tree_server(engine):
    """A server whose backend (the session's engine) says it drafts trees up to width 2."""
    backend = RecordingBackend(engine)
    backend.info = dataclasses.replace(engine.info, max_tree_width=2)
    s = ServerThread(backend, ServerConfig(port=0, admin_token=ADMIN_TOKEN))
    yield s
    s.stop()


def test_client_policy_set_takes_a_tree_width(tree_server, capsys):
    code, out, _ = run_cli(capsys, "client", "policy", "set", "--server", tree_server.address, "--admin-token",
                           ADMIN_TOKEN, "--draft-length", "6", "--draft-temperature", "0", "--tree-width", "2")
    assert code == 0 and json.loads(out)["tree_width"] == 2 and json.loads(out)["policy_id"] == "model-k6-t0-tw2"
    code, _, err = run_cli(capsys, "client", "policy", "set", "--server", tree_server.address, "--admin-token",
                           ADMIN_TOKEN, "--draft-length", "6", "--tree-width", "3")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: policy.tree_width: 3 is not offered")
    code, _, err = run_cli(capsys, "client", "policy", "set", "--server", tree_server.address, "--admin-token",
                           ADMIN_TOKEN, "--drafter", "ngram", "--draft-length", "6", "--tree-width", "2")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: policy.tree_width") and "chains only" in err


def test_client_policy_without_the_token_exits_1_with_the_status(server, capsys, monkeypatch):
    monkeypatch.delenv("MOESPEC_ADMIN_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "client", "policy", "get", "--server", server.address)
    assert code == 1 and err.startswith("UNAUTHENTICATED")


def test_client_info_and_health(server, capsys):
    code, out, _ = run_cli(capsys, "client", "info", "--server", server.address)
    assert code == 0 and json.loads(out)["num_experts"] > 0
    code, out, _ = run_cli(capsys, "client", "health", "--server", server.address)
    assert code == 0 and out.strip() == "SERVING"


def test_client_invalid_argument_exits_1_naming_the_field(server, capsys):
    code, _, err = run_cli(capsys, "client", "generate", "--server", server.address, "--prompt", "x",
                           "--top-p", "2")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: sampling.top_p")


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--backend", "sglang", "--port", "0"], "model"),
        (["--tls-cert", "cert.pem", "--port", "0"], "--tls-cert and --tls-key go together"),
        (["--port", "70000"], "--port must be in"),
        (["--draft-length", "99", "--port", "0"], "initial draft policy"),
        (["--max-batch", "0", "--port", "0"], "--max-batch must be >= 1"),
        (["--workers", "0", "--port", "0"], "--workers must be >= 1"),
        (["--prefill-chunk", "0", "--port", "0"], "--prefill-chunk must be >= 1"),
        (["--steps-per-call", "0", "--port", "0"], "--steps-per-call must be >= 1"),
        (["--drafter", "ngram", "--draft-length", "3", "--tree-width", "2", "--port", "0"],
         "initial draft policy: policy.tree_width"),
    ],
    ids=["sglang-without-model", "tls-half", "port-range", "policy-bounds", "max-batch", "workers", "prefill-chunk",
         "steps-per-call", "ngram-tree"],
)
def test_serve_bad_arguments_exit_2_with_a_one_line_reason(args, reason, capsys):
    code, _, err = run_cli(capsys, "serve", *args)
    assert code == 2, err
    assert reason in err and len(err.strip().splitlines()) == 1


def test_serve_bad_argument_exits_2_from_a_real_process():
    # Through service.cli.main, as the `moespec` script runs it (`python -m service.cli` would define
    # a second UsageError class in __main__ that main() does not catch).
    entry = "import sys; from service.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", entry, "serve", "--port", "70000"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--port must be in" in proc.stderr
