"""Tree steps in step recordings and the what-if replay: a recording keeps a tree's shape and which
nodes were accepted (old files without them still load as chains), and the replay, which predicts
chains only, leaves tree steps out and says so, instead of mixing them in."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from service.recording import RecordingError, StepRecorder, read_recording
from service.types import Drafter, DraftPolicy, GenerationRequest, StepRecord
from service.whatif.hint import replay_trial
from service.whatif.predict import predict
from service.whatif.present import format_table
from tests.support.engine_helpers import make_engine
from tests.whatif.test_whatif import H, M, info, synthetic_step

# Nodes 0 and 1 hang off the window's first token r, node 2 off node 0; the target accepted 0 then 2.
PARENTS = (-1, -1, 0)
# [L, w, m], positions r, 0, 1, 2. Layer 0: r {0,1}, 0 {2,3}, 1 {4,5}, 2 {2,3}; layer 1: {8,9} but node 1 {10,11}.
TOPK = (((0, 1), (2, 3), (4, 5), (2, 3)), ((8, 9), (8, 9), (10, 11), (8, 9)))
UNION = (6, 4)  # every position of the tree
BRANCHES = ((4, 4), (4, 2))  # leaf 1: r, 1; leaf 2: r, 0, 2 (leaves in node order)


def tree_step(policy_id: str = "model-k3-t0-tw2") -> StepRecord:
    return StepRecord(
        drafter=Drafter.MODEL, draft_length=3, draft_temperature=0.0, policy_id=policy_id, drafted=3, accepted=2,
        committed=3, accepted_per_position=(True, False, True), window=4, unique_experts=UNION, shared_experts=1,
        unique_experts_bound=8, draft_seconds=1e-3, verify_seconds=4e-3, decode_step_equivalents=2.0,
        topk_ids=TOPK, window_ids=(7, 8, 9, 10), pairwise_overlap_mean=(0.5, 1.0), pairwise_overlap_min=(0, 0),
        tree_width=2, tree_parents=PARENTS, branch_unique=BRANCHES,
    )


def write(path, *requests) -> None:
    recorder = StepRecorder(path, info(), hidden_size=H)
    for request in requests:
        recorder.write(request)
    recorder.close()


def test_a_tree_step_round_trips_with_its_shape_path_and_recounted_branch_unions(tmp_path):
    path = tmp_path / "steps.jsonl"
    write(path, (tree_step(), synthetic_step(3, 3, 1)))
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert (lines[0]["tw"], lines[0]["parents"], lines[0]["flags"]) == (2, [-1, -1, 0], "101")
    assert "tw" not in lines[1] and "parents" not in lines[1]  # a chain's line is what it was
    tree, chain = read_recording(path).steps
    assert tree.tree_width == 2 and tree.tree_parents == PARENTS
    assert tree.accepted_per_position == (True, False, True)  # the path, not a prefix
    assert tree.unique_experts == UNION and tree.branch_unique == BRANCHES  # recounted from the ids
    assert dataclasses.replace(tree, pairwise_overlap_mean=(), pairwise_overlap_min=()) == dataclasses.replace(
        tree_step(), pairwise_overlap_mean=(), pairwise_overlap_min=())
    assert chain == synthetic_step(3, 3, 1)


def test_flags_that_are_not_a_path_from_the_root_are_refused_with_the_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    write(path, (tree_step(),))
    header, line = path.read_text().splitlines()
    for flags in ("011", "110", "100"):  # 1 then 2 (2 hangs off 0); 0 and its sibling 1; one node for 2 accepted
        path.write_text(header + "\n" + line.replace('"flags":"101"', f'"flags":"{flags}"') + "\n")
        with pytest.raises(RecordingError, match=r"steps.jsonl:2: malformed step .*not a path"):
            read_recording(path)


def test_tree_steps_are_left_out_of_the_replay_and_counted():
    chains = [(synthetic_step(3, 3, 2), synthetic_step(3, 3, 0)), (synthetic_step(3, 1, 1),)]
    # the same requests with tree steps between and after their chain steps (a table with a tree cell)
    mixed = [(synthetic_step(3, 3, 2), tree_step(), synthetic_step(3, 3, 0), tree_step()),
             (tree_step(), synthetic_step(3, 1, 1))]
    alone, skipped = predict(chains, M), predict(mixed, M)
    assert skipped.tree_steps_skipped == 3 and alone.tree_steps_skipped == 0
    assert skipped.steps == alone.steps == 3
    # the chain steps around a tree step are separate runs: the walk never crosses the tree's positions
    assert skipped.requests == 3
    assert [p.committed_per_step_truncated for p in skipped.predictions] == [
        p.committed_per_step_truncated for p in alone.predictions]
    assert "3 tree steps skipped: the replay predicts chains only" in format_table(skipped)
    assert "tree steps skipped" not in format_table(alone)


def test_a_run_of_tree_steps_only_is_refused_saying_why():
    with pytest.raises(ValueError, match="all 2 recorded steps are of tree policies: the replay predicts chains only"):
        predict([(tree_step(), tree_step())], M)


def test_the_tuners_hint_skips_a_tree_trial(tmp_path):
    path = tmp_path / "steps.jsonl"
    write(path, tuple(tree_step("trial-3") for _ in range(30)))
    tree = DraftPolicy(Drafter.MODEL, 3, 0.0, "trial-3", tree_width=2)
    assert replay_trial(path, tree, min_steps=1) is None


def whatif(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "whatif", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_cli_replays_the_chain_policy_by_default_and_refuses_a_tree_one_in_one_line(tmp_path):
    path = tmp_path / "run.jsonl"
    chain = tuple(synthetic_step(3, 3, a) for a in (2, 0, 1))
    write(path, chain, tuple(tree_step() for _ in range(5)))  # the tree policy has more steps
    out = whatif(str(path), "--out", str(tmp_path / "o"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "o" / "whatif.json").read_text())["policy_id"] == "p"
    tree = whatif(str(path), "--policy", "model-k3-t0-tw2", "--out", str(tmp_path / "t"))
    assert tree.returncode == 2
    assert tree.stderr.strip().endswith("all 5 recorded steps are of tree policies: the replay predicts chains only; "
                                        "a tree's acceptance depends on the tree's shape")
    assert len(tree.stderr.strip().splitlines()) == 1


def test_the_engines_tree_steps_survive_a_recording_and_their_branch_unions_recount_the_same(tmp_path):
    """The engine counts each branch's union from its routing; the loader recounts it from the recorded
    ids with the same parents: the two must agree, and the accepted path must come back as recorded."""
    engine = make_engine(capture_topk=True)
    try:
        result = engine.generate(GenerationRequest(prompt="def add(a, b):\n", max_new_tokens=12),
                                 DraftPolicy(Drafter.MODEL, 6, 0.0, "tw2", tree_width=2))
        path = tmp_path / "steps.jsonl"
        recorder = StepRecorder(path, engine.info, hidden_size=H)
        recorder.write(result.steps)
        recorder.close()
    finally:
        engine.close()
    loaded = read_recording(path).steps
    assert any(s.is_tree for s in result.steps)
    for recorded, back in zip(result.steps, loaded, strict=True):
        assert (back.tree_width, back.tree_parents, back.branch_unique) == (
            recorded.tree_width, recorded.tree_parents, recorded.branch_unique)
        assert (back.accepted_per_position, back.unique_experts) == (
            recorded.accepted_per_position, recorded.unique_experts)
