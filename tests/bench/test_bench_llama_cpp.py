"""`moespec bench llamacpp`: its refusal where llama.cpp is not built, its round-by-round ratios, the
converter wrapper's tokenizer check, and (where scripts/setup_llama_cpp.sh has run) a short real run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess

import pytest

from service.bench.llama_cpp import DEFAULT_DIR, TOOLS, summarise
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT


def load_converter_wrapper():
    spec = importlib.util.spec_from_file_location("llama_cpp_convert", REPO_ROOT / "scripts" / "llama_cpp_convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_llama_cpp_the_bench_exits_2_naming_the_setup_script(tmp_path):
    run = subprocess.run([*MOESPEC, "bench", "llamacpp", "--llama-cpp-dir", str(tmp_path)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "scripts/setup_llama_cpp.sh" in run.stderr and "Traceback" not in run.stderr


def test_ratios_pair_each_round_of_moespec_with_the_same_round_of_llama_cpp():
    args = argparse.Namespace(draft_lengths=[2], batch=[4], server_clients=[1, 4], threads=2, depth=96, tokens=48,
                              rounds=2)
    samples = {"decode moespec": [100.0, 300.0], "decode llama.cpp": [200.0, 200.0],
               "prefill moespec": [10.0, 10.0], "prefill llama.cpp": [5.0, 20.0],
               "speculative k=2 moespec dense draft": [1.0, 1.0], "speculative k=2 moespec draft head": [2.0, 2.0],
               "speculative k=2 llama.cpp": [1.0, 1.0],
               "batch 4 generation_tokens_per_second moespec": [4.0, 4.0],
               "batch 4 generation_tokens_per_second llama.cpp": [2.0, 2.0],
               "batch 4 output_tokens_per_second moespec": [3.0, 3.0],
               "batch 4 output_tokens_per_second llama.cpp": [3.0, 3.0],
               "server 1 moespec": [1.0, 2.0], "server 1 llama.cpp": [2.0, 2.0],
               "server 4 moespec": [2.7, 1.5], "server 4 llama.cpp": [1.0, 1.0]}
    result = summarise(args, samples)
    ratios = result["moespec_over_llama_cpp"]
    assert ratios["decode"] == {"median": 1.0, "min": 0.5, "max": 1.5}
    assert ratios["prefill"]["min"] == 0.5 and ratios["prefill"]["max"] == 2.0
    assert ratios["speculative k=2 (draft head)"]["median"] == 2.0
    assert ratios["batch 4 generation"]["median"] == 2.0 and ratios["batch 4 output"]["median"] == 1.0
    assert ratios["server 1 clients"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert ratios["server 4 clients"]["max"] == 2.7
    # The gRPC layer's share: moespec's server figure over its in-process batched one, round by round.
    assert result["moespec_server_over_in_process"] == {"4": pytest.approx({"median": 0.7, "min": 0.5, "max": 0.9})}


def test_the_converter_is_told_qwen2_only_for_a_tokenizer_that_splits_like_qwen2(tmp_path):
    wrapper = load_converter_wrapper()
    for model in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR):
        assert wrapper.split_regexes(model / "tokenizer.json") == [wrapper.QWEN2_SPLIT]
    other = json.loads((DEFAULT_TARGET_DIR / "tokenizer.json").read_text())
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\w+"  # a GPT-2-like split
    (tmp_path / "tokenizer.json").write_text(json.dumps(other))
    assert wrapper.split_regexes(tmp_path / "tokenizer.json") != [wrapper.QWEN2_SPLIT]


@pytest.mark.skipif(os.environ.get("MOESPEC_TEST_LLAMA_CPP") != "1"
                    or not all((DEFAULT_DIR / "src" / "build" / "bin" / t).exists() for t in TOOLS)
                    or not (DEFAULT_DIR / "models" / "draft-bf16.gguf").exists(),
                    reason="opt-in (MOESPEC_TEST_LLAMA_CPP=1) after bash scripts/setup_llama_cpp.sh; CI does not "
                           "need llama.cpp")
def test_a_short_real_run_measures_every_mode_on_both_sides(tmp_path):
    run = subprocess.run([*MOESPEC, "bench", "llamacpp", "--rounds", "1", "--depth", "16",
                          "--tokens", "8", "--draft-lengths", "2", "--batch", "2", "--server-clients", "1", "2",
                          "--out", str(tmp_path)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "llamacpp.json").read_text())
    assert set(result["moespec_over_llama_cpp"]) == {"decode", "prefill", "speculative k=2 (dense draft)",
                                                     "speculative k=2 (draft head)", "batch 2 generation",
                                                     "batch 2 output", "server 1 clients", "server 2 clients"}
    assert all(v > 0 for values in result["samples"].values() for v in values if v == v)


def _tool(path, body: str):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_a_tool_run_that_prints_no_result_is_run_again(tmp_path):
    """What llama-batched-bench does about 1 run in 20: exit 0 having printed nothing after its set-up."""
    from service.bench.llama_cpp import _run

    runs = tmp_path / "runs"
    flaky = _tool(tmp_path / "llama-flaky", f'echo run >> {runs}\n[ "$(wc -l < {runs})" -ge 2 ] && echo "speed 7"\n'
                                            "exit 0\n")
    out, found = _run([str(flaky)], r"speed (\d+)")
    assert found[1] == "7" and runs.read_text().count("run") == 2


def bench_with_stand_ins(tmp_path, tool_body: str, *server_clients: str) -> subprocess.CompletedProcess:
    """`moespec bench llamacpp` (one short round) over stand-in tools that all run `tool_body`."""
    bin_dir = tmp_path / "src" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in TOOLS:
        _tool(bin_dir / name, tool_body)
    (tmp_path / "models").mkdir()
    for model in ("target-bf16.gguf", "draft-bf16.gguf"):
        (tmp_path / "models" / model).write_text("")
    return subprocess.run([*MOESPEC, "bench", "llamacpp", "--llama-cpp-dir", str(tmp_path), "--rounds", "1",
                           "--tokens", "4", "--depth", "8", "--draft-lengths", "1", "--batch", "2",
                           "--server-clients", *server_clients, "--out", str(tmp_path / "out")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_a_tool_that_never_prints_a_result_fails_the_bench_with_one_line_naming_it(tmp_path):
    run = bench_with_stand_ins(tmp_path, "echo 'W llama_context: set up' >&2\nexit 0\n")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "llama-bench printed no result in 5 runs (its last line: 'W llama_context: set up')" in run.stderr


STAND_IN_SERVER = """#!/usr/bin/env python3
# A llama-server stand-in: /health, and /completion answering n_predict tokens; logs argv and bodies.
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
log = open(LOG, "a")
log.write(json.dumps({"argv": sys.argv[1:]}) + "\\n"); log.flush()
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._answer({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({"body": body}) + "\\n"); log.flush()
        self._answer({"tokens_predicted": body["n_predict"]})
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_the_server_mode_asks_llama_server_for_its_slots_and_fresh_prefills(tmp_path):
    """LlamaServer starts llama-server with a slot per client and a context that holds them all, and
    every request sends the prompt's ids uncached (the moespec side pays every prefill too), greedy,
    generating exactly the asked tokens; concurrent_load counts what the answers report."""
    from service.bench.llama_cpp_server import LlamaServer, concurrent_load

    log = tmp_path / "calls.jsonl"
    server = _tool(tmp_path / "llama-server", "")  # executable; its text follows
    server.write_text(STAND_IN_SERVER.replace("LOG", repr(str(log))))
    prompts = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    with LlamaServer(server, tmp_path / "target.gguf", threads=2, slots=3, context_per_slot=64) as llama:
        assert concurrent_load(llama.complete, prompts, 5) > 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    argv = calls[0]["argv"]
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-c") + 1] == "192"
    assert argv[argv.index("-t") + 1] == "2"
    bodies = [c["body"] for c in calls[1:]]
    assert sorted(tuple(b["prompt"]) for b in bodies) == prompts
    assert all(b["n_predict"] == 5 and b["temperature"] == 0 and b["cache_prompt"] is False and b["ignore_eos"]
               for b in bodies)


def test_a_llama_server_that_exits_at_start_fails_the_bench_with_one_line(tmp_path):
    run = bench_with_stand_ins(tmp_path, "exit 3\n", "2")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "llama-server exited 3 at start" in run.stderr
