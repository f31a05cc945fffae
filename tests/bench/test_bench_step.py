"""`moespec bench step` on a real `moespec serve` and an in-process engine: every round of both paths
splits a decode step into its verify pass, its forward and the rest, from the engine's own clocks."""

from __future__ import annotations

import argparse
import json

import pytest

from service.bench import step
from service.errors import UsageError


def test_each_round_of_both_paths_splits_a_step_into_its_verify_pass_and_the_rest(tmp_path, capsys):
    args = argparse.Namespace(prompts=2, max_new_tokens=24, rounds=2, steps_per_call=[8, 1], out=tmp_path)
    assert step.run(args) == 0
    rows = json.loads((tmp_path / "step.json").read_text())
    # interleaved: each round runs both paths at both settings, the second round in the reverse order
    first = [(8, "served"), (8, "in_process"), (1, "served"), (1, "in_process")]
    assert [(r["round"], r["steps_per_call"], r["path"]) for r in rows] == (
        [(0, *x) for x in first] + [(1, *x) for x in first[::-1]])
    for r in rows:  # a step holds its verify pass and more (the scheduler, the records, the commit)
        assert 0 < r["verify_us"] < r["step_us"] and 0 < r["outside_share"] < 1
        assert r["forward_us"] > 0 and r["outside_forward_share"] < 1
        if r["path"] == "in_process" and r["steps_per_call"] == 1:  # the same engine's verify pass holds its
            assert r["forward_us"] < r["verify_us"]  # forward (the served engine is another process)
        if r["path"] == "in_process" and r["steps_per_call"] == 8:  # inside a call, a step's verify pass is its
            assert r["forward_us"] <= r["verify_us"] * 1.001  # forward (only the first step runs alone)
    assert rows[0]["forward_us"] == rows[1]["forward_us"]  # one round, one in-process forward per engine
    out = capsys.readouterr().out
    assert "work outside the verify pass" in out and "work outside the forward" in out


def test_the_split_reads_the_decode_steps_not_the_prefill():
    """(seconds - time to first token) over the steps after the first token; verify over verify steps."""
    class Spec:
        verify_seconds, verify_steps = 0.006, 3

    class Result:
        seconds, time_to_first_token, token_ids, spec = 0.012, 0.004, (1, 2, 3, 4, 5), Spec

    row = step.split("served", 0, [Result])
    assert row.step_us == pytest.approx(2000) and row.verify_us == pytest.approx(2000 * 1.0)
    assert row.outside_share == pytest.approx(0.0)


def test_bad_arguments_are_named():
    with pytest.raises(UsageError, match="--max-new-tokens"):
        step.run(argparse.Namespace(prompts=1, max_new_tokens=1, rounds=1, steps_per_call=[8], out=None))
    with pytest.raises(UsageError, match="--steps-per-call"):
        step.run(argparse.Namespace(prompts=1, max_new_tokens=8, rounds=1, steps_per_call=[0], out=None))
