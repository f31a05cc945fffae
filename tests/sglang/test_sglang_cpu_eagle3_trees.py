"""EAGLE-3 draft trees on a real SGLang 0.5.23 on this CPU, through `moespec serve --backend sglang`.

A tree policy (tree_width w > 1) runs SGLang's EAGLE-2 tree: speculative_eagle_topk = w over k draft
steps, the k best candidates verified in one window under a tree mask. What must hold:
- lossless: every reply equals plain greedy decoding (the embedded engine's, which SGLang's own plain
  decoding equals on these prompts in fp32, test_sglang_cpu.py), for trees of several lengths and widths,
  and for chains of lengths 1-4 of the same draft on the same 8 prompts;
- the plugin's unions are the routing's: each reply's whole-tree and per-branch union aggregates (measured
  on the scheduler's device from the tree links) equal a recount from the step recording's routed ids;
- the routing is each node's own: transformers' router over the committed prefix + a node's path picks
  the experts the recording holds for that node, so the unions are those of the tree SGLang verified.
Runs only in the SGLang venv (scripts/test.sh), like test_sglang_cpu.py.
"""

from __future__ import annotations

import pytest

from service.recording import read_recording
from service.types import Drafter, DraftPolicy, SpecStats
from tests.sglang.test_sglang_cpu import (
    SERVE_SGLANG,
    connect,
    greedy,
    plain_greedy_outputs,
    require_sglang,
    serve,
    sglang_env,
    tokenize,
)
from tests.support.engine_helpers import heldout_prompts
from tests.support.router_oracle import load_router_oracle, tree_routed

pytestmark = pytest.mark.sglang_cpu

TOKEN = "sglang-cpu-eagle3-trees-test"
PROMPTS = heldout_prompts(8)
MAX_NEW = 24
# (draft length k, tree width w): the server starts at the first; the others are engine swaps.
TREES = ((4, 2), (2, 2), (3, 4))
CHAINS = (1, 2, 3, 4)  # then chains on the same prompts: one swap to the prepared engine, then pins
ORACLE_REQUESTS = 2  # per tree policy, every step recounted by transformers


def tree_policy(k: int, w: int) -> DraftPolicy:
    return DraftPolicy(drafter=Drafter.MODEL, draft_length=k, tree_width=w, policy_id=f"tree-k{k}-w{w}")


@pytest.fixture(scope="module")
def steps_file(tmp_path_factory):
    return tmp_path_factory.mktemp("eagle3-trees") / "steps.jsonl"


@pytest.fixture(scope="module")
def server(steps_file):
    require_sglang()
    k, w = TREES[0]
    # SGLang's own ranking (temperature 1): it branches far more often than the shipped draft's calibrated one,
    # so the trees checked here are trees.
    args = ("--backend", "sglang", *SERVE_SGLANG, "--speculative-algorithm", "EAGLE3", "--sglang-no-ngram",
            "--sglang-no-calibrate", "--drafter", "model", "--draft-length", str(k), "--tree-width", str(w),
            "--sglang-tree-temperature", "1", "--record-steps", str(steps_file), "--log-level", "INFO")
    yield from serve(sglang_env(), TOKEN, args)


@pytest.fixture(scope="module")
def client(server):
    yield from connect(server, TOKEN)


@pytest.fixture(scope="module")
def replies() -> list:
    return []  # (policy, prompt ids, reply) of every request, in the order sent (the recording's order)


def test_trees_are_offered_and_every_tree_reply_equals_plain_greedy(client, replies):
    info = client.model_info()
    assert info.max_tree_width == 4 and "tree_width" in info.tunable
    plain = plain_greedy_outputs(PROMPTS, MAX_NEW)
    for k, w in TREES:
        policy = tree_policy(k, w)
        client.set_policy(policy)
        for prompt, prompt_ids in zip(PROMPTS, tokenize(PROMPTS), strict=True):
            reply = client.generate(greedy(prompt, MAX_NEW), timeout=600)
            replies.append((policy, prompt_ids, reply))
            assert reply.token_ids == plain[prompt], (k, w, prompt[:40])  # lossless
            spec = reply.spec
            assert (spec.drafter, spec.draft_length, spec.tree_width) == (Drafter.MODEL, k, w)
            assert spec.verify_steps > 0 and spec.drafted_tokens == k * spec.verify_steps
            assert spec.committed_tokens == len(reply.token_ids) - 1  # the first token came from the prefill
    assert client.model_info().policy_switches == len(TREES) - 1  # a tree is an engine of its own


def test_chains_of_lengths_1_to_4_on_the_same_prompts_equal_plain_greedy(client, replies):
    """The same checkpoint as chains (after the trees: the module's recording holds the trees first)."""
    assert len(replies) == len(TREES) * len(PROMPTS)  # the trees ran first
    plain = plain_greedy_outputs(PROMPTS, MAX_NEW)
    swaps = client.model_info().policy_switches
    for k in CHAINS:
        client.set_policy(DraftPolicy(drafter=Drafter.MODEL, draft_length=k, policy_id=f"chain-k{k}"))
        for prompt in PROMPTS:
            reply = client.generate(greedy(prompt, MAX_NEW), timeout=600)
            assert reply.token_ids == plain[prompt], (k, prompt[:40])
            assert (reply.spec.tree_width, reply.spec.draft_length) == (1, k)
            assert reply.spec.drafted_tokens == k * reply.spec.verify_steps
    assert client.model_info().policy_switches == swaps + 1  # one swap to the prepared engine, then pins


def test_the_plugins_tree_and_branch_unions_equal_a_recount_of_the_recorded_routing(client, steps_file, replies):
    """Per reply: the response's whole-tree and per-branch union aggregates, from the plugin's device
    counts, against the same aggregates recounted from the step recording's routed ids and tree parents."""
    assert len(replies) == len(TREES) * len(PROMPTS)
    recording = read_recording(steps_file)
    assert len(recording.requests) >= len(replies)  # the trees' requests first (then the chains')
    layers = client.model_info().num_layers
    branched = {policy.policy_id: 0 for policy, _, _ in replies}
    for (policy, _, reply), steps in zip(replies, recording.requests[:len(replies)], strict=True):
        assert len(steps) == reply.spec.verify_steps and all(s.tree_width == policy.tree_width for s in steps)
        branched[policy.policy_id] += sum(s.branches > 1 for s in steps)
        recount = SpecStats.from_steps(list(steps), policy, layers)
        got = reply.spec
        assert got.accepted_tokens == recount.accepted_tokens
        assert got.accepted_per_position == recount.accepted_per_position
        assert got.unique_experts_max == recount.unique_experts_max
        assert got.unique_experts_mean == pytest.approx(recount.unique_experts_mean)
        assert got.branch_unique_experts_mean == pytest.approx(recount.branch_unique_experts_mean)
    assert all(count > 0 for count in branched.values()), branched  # every policy verified real trees


def test_each_nodes_recorded_routing_is_transformers_router_over_its_own_path(steps_file, replies):
    """The first requests of every tree policy, every tree step: node by node, the experts transformers'
    router picks after the committed prefix and the node's own path are the ones recorded for it."""
    oracle = load_router_oracle()
    recording = read_recording(steps_file)
    checked = 0
    for index, ((policy, prompt_ids, reply), steps) in enumerate(zip(replies, recording.requests[:len(replies)],
                                                                     strict=True)):
        if index % len(PROMPTS) >= ORACLE_REQUESTS:
            continue
        done = 1  # the prefill committed the first output token
        for step in steps:
            committed = list(prompt_ids) + list(reply.token_ids[:done])
            done += step.committed
            if not step.is_tree:
                continue
            window = list(step.window_ids)
            assert window[0] == committed[-1]
            routed = tree_routed(oracle, committed, window, step.tree_parents).sort(-1).values  # [L, w, m]
            recorded = [[sorted(position) for position in layer] for layer in step.topk_ids]
            assert routed.tolist() == recorded, (policy.policy_id, index, step.tree_parents)
            checked += 1
    assert checked >= len(TREES) * ORACLE_REQUESTS
