"""`moespec serve --ep-size --record-steps` as a real process: a real gRPC client's requests are
recorded with their EP view, and `moespec whatif` reads the file the server wrote; bad EP and
recording flags exit 2 with one line before any model loads."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2_grpc as pb_grpc
from service.recording import read_recording
from service.server import convert
from service.types import GenerationRequest, SamplingParams
from tests.cli.test_grpc_cli import run_cli
from tuner.drivers.server_proc import MOESPEC, REPO_ROOT, start_server


@pytest.mark.parametrize(("args", "reason"), [
    (["--ep-placement", "p.json"], "--ep-placement needs --ep-size"),
    (["--ep-size", "-2"], "--ep-size must be >= 1"),
    (["--ep-size", "2", "--ep-placement", "/nonexistent/p.json"], "cannot read placement"),
    (["--record-steps", "/nonexistent/folder/steps.jsonl"], "--record-steps: no folder"),
], ids=["placement-alone", "negative-size", "missing-placement", "record-folder"])
def test_bad_ep_and_recording_flags_exit_2_with_one_line(args, reason, capsys):
    code, _, err = run_cli(capsys, "serve", "--port", "0", *args)
    assert code == 2, err
    assert reason in err and len(err.strip().splitlines()) == 1


def test_served_requests_are_recorded_and_replayed_by_whatif(tmp_path):
    path = tmp_path / "steps.jsonl"
    server = start_server({}, "t", ("--threads", "1", "--drafter", "ngram", "--draft-length", "4",
                                    "--ep-size", "4", "--record-steps", str(path)))
    replies = []
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for prompt in ("def f(x):\n", "class A:\n    def __init__(self):\n"):
                request = GenerationRequest(prompt=prompt, max_new_tokens=16, sampling=SamplingParams(temperature=0))
                replies.append(stub.Generate(convert.request_to_pb(request), timeout=60))
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log_tail()
    recording = read_recording(path)
    assert len(recording.requests) == 2
    for reply, steps in zip(replies, recording.requests, strict=True):
        assert len(steps) == reply.spec.verify_steps
        assert sum(s.committed for s in steps) == len(reply.token_ids)
        assert all(s.draft_length == 4 and s.topk_ids is not None for s in steps)
    out = subprocess.run([*MOESPEC, "whatif", str(path), "--ep-size", "4"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "steps.jsonl.whatif.json").read_text())
    assert [p["draft_length"] for p in data["predictions"]] == [0, 1, 2, 3, 4]
    assert all(1 <= r <= 4 for p in data["predictions"] for r in p["ep_ranks_touched_mean"])
