"""Draft trees through `Engine.generate`: greedy output is plain decoding's for every shape, alone and
batched beside chains and plain requests; sampled output follows the target's joint law of the first
two tokens; the records name the tree and its accepted path; the per-branch and whole-tree unions
equal a recount by transformers' own router over each node's path (the independent oracle)."""

from __future__ import annotations

import threading

import pytest
import torch

from service.types import DraftPolicy, GenerationRequest, InvalidRequest, SamplingParams, tree_branches
from tests.engine.spec.test_speculative_lossless import (  # noqa: F401 (fixtures)
    ALPHA,
    E2E_REQUESTS,
    SAMPLING,
    FirstTwoTokens,
    engine,
    spread_law,
    spread_prompt,
)
from tests.support.engine_helpers import first_tree_steps, heldout_prompts, prefilled_sequence
from tests.support.router_oracle import distinct, load_router_oracle, tree_routed

GREEDY = SamplingParams(temperature=0)
SHAPES = [(2, 2), (3, 2), (4, 2), (6, 3), (8, 4), (8, 2)]  # (node budget, width)


@pytest.fixture(scope="module")
def plain_outputs(engine):  # noqa: F811
    return [(p, engine.generate(GenerationRequest(prompt=p, max_new_tokens=40, sampling=GREEDY), DraftPolicy()))
            for p in heldout_prompts(3)]


@pytest.mark.parametrize("budget,width", SHAPES)
def test_greedy_trees_give_the_plain_decoding_output(engine, plain_outputs, budget, width):  # noqa: F811
    for temperature in (0.0, 1.0):
        policy = DraftPolicy(draft_length=budget, tree_width=width, draft_temperature=temperature)
        for prompt, plain in plain_outputs:
            spec = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)
            assert spec.token_ids == plain.token_ids
            trees = [s for s in spec.steps if s.tree_parents]
            assert trees and all(s.tree_width == width and s.window == s.drafted + 1 for s in trees)
            for step in trees:  # the accepted flags mark one root-to-node path of the accepted length
                on_path = [i for i, ok in enumerate(step.accepted_per_position) if ok]
                assert len(on_path) == step.accepted
                assert all(step.tree_parents[b] == a for a, b in zip([-1, *on_path], on_path, strict=False))


def test_trees_beside_chains_and_plain_requests_in_one_pass_keep_every_output(engine, plain_outputs):  # noqa: F811
    """Concurrent requests share verify passes: tree windows, chain windows and plain steps of other
    slots in the same pass (the tree's accepted path moves in the cache after each verdict)."""
    policies = [DraftPolicy(draft_length=6, tree_width=3), DraftPolicy(draft_length=3, draft_temperature=0),
                DraftPolicy(), DraftPolicy(draft_length=4, tree_width=2, draft_temperature=0.5)]
    results = {}

    def run(i, prompt, policy):
        results[i] = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)

    jobs = [(i, prompt, policy) for i, (policy, (prompt, _)) in
            enumerate((pol, out) for pol in policies for out in plain_outputs)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plain = dict(plain_outputs)
    for i, prompt, _ in jobs:
        assert results[i].token_ids == plain[prompt].token_ids
    assert any(len(s.batch.windows) > 1 for r in results.values() for s in r.steps if s.tree_parents)


def test_a_tree_on_an_engine_without_a_draft_head_is_refused_naming_the_field(engine):  # noqa: F811
    from service.engine.model.weights import DEFAULT_DRAFT_DIR
    from tests.support.engine_helpers import make_engine

    dense = make_engine(draft_dir=DEFAULT_DRAFT_DIR)
    try:
        assert dense.info.max_tree_width == 1 and "tree_width" not in dense.info.tunable
        with pytest.raises(InvalidRequest, match="tree_width"):
            dense.generate(GenerationRequest(prompt="x = 1", max_new_tokens=4), DraftPolicy(draft_length=3,
                                                                                           tree_width=2))
    finally:
        dense.close()
    assert engine.info.max_tree_width > 1 and "tree_width" in engine.info.tunable


# ------------------------------------------------------------------ sampled: the target's law
@pytest.mark.slow  # 400 seeded requests: ~20-60 s on 2 shared cores
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["top-candidates", "sampled-branches"])
def test_sampled_trees_give_the_target_joint_law_of_the_first_two_tokens(engine, spread_prompt, spread_law,  # noqa: F811
                                                                        temperature):
    """Each request's first step verifies a tree of 3 nodes (4 new tokens leave room for them): the
    first two committed tokens follow p(t1) p(t2 | t1), whichever branch, child or residual gave them;
    for the head's top candidates (point masses) and for branches drawn from q (q's rule)."""
    TREE = DraftPolicy(draft_length=3, tree_width=2, draft_temperature=temperature)
    outputs, first_steps = first_tree_steps(engine, spread_prompt[1], TREE, SAMPLING, E2E_REQUESTS)
    # Every half of the rule ran: a first child accepted, a later sibling accepted after a rejection
    # (the residual updated), and every child rejected (the bonus from the residual).
    first_child = [s for s in first_steps if s.accepted_per_position[0]]
    sibling = [s for s in first_steps if s.accepted and not s.accepted_per_position[0]]
    none = [s for s in first_steps if s.accepted == 0]
    assert all(s.tree_parents.count(-1) >= 2 for s in first_steps[:20]), "the root should have two children"
    assert min(len(first_child), len(sibling), len(none)) >= 5, (len(first_child), len(sibling), len(none))
    assert spread_law.pvalue(outputs) > ALPHA


# ------------------------------------------------------------------ unions against transformers' router
@pytest.fixture(scope="module")
def oracle():
    return load_router_oracle()


@pytest.fixture(scope="module")
def recording_engine():
    from tests.support.engine_helpers import make_engine

    recording = make_engine(capture_topk=True)  # each record keeps its window's tokens and routed ids
    yield recording
    recording.close()


def test_tree_unions_equal_transformers_router_over_each_nodes_path(recording_engine, oracle):
    """Recorded tree steps: each node's experts are recounted by transformers over the committed
    prefix + its own path (all the node sees), then unioned over every node (the record's
    unique_experts) and over every root-to-leaf branch (branch_unique)."""
    prompt_ids = recording_engine.tokenizer.encode(heldout_prompts(4)[3]).ids
    request = GenerationRequest(prompt_token_ids=tuple(prompt_ids), max_new_tokens=12, sampling=GREEDY)
    # (sampled branches: three root children every step, whatever the head is sure of)
    result = recording_engine.generate(request, DraftPolicy(draft_length=6, tree_width=3, draft_temperature=0.8))
    done, checked, branched = 0, 0, 0  # tokens committed before the step
    for step in result.steps:
        committed = prompt_ids + list(result.token_ids[:done])
        done += step.committed
        if not step.tree_parents:
            continue
        window = list(step.window_ids)  # [last committed token, nodes...]
        assert window[0] == committed[-1]
        if step.drafted == 6:  # sampled branches: three draws at the root, the first continued three deep
            assert step.tree_parents == (-1, -1, -1, 0, 3, 4)
        routed = tree_routed(oracle, committed, window, step.tree_parents)  # [L, w, m]
        assert step.unique_experts == distinct(routed)
        branches = tree_branches(step.tree_parents)
        assert len(step.branch_unique) == len(branches)
        branched += len(branches) > 1
        for got, branch in zip(step.branch_unique, branches, strict=True):
            assert got == distinct(routed[:, [0, *(1 + i for i in branch)]])
        checked += 1
    assert checked >= 2 and branched >= 1


# ------------------------------------------------------------------ the C tree against the Python reference
@pytest.mark.parametrize("budget,width", [(4, 2), (8, 2), (8, 3), (6, 4)])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=1)], ids=str)
def test_the_kernels_top_candidate_tree_is_the_reference_growths(engine, budget, width, sampling):  # noqa: F811
    """`Kernels.head_tree` (one C call) against the rule grown step by step in torch
    (tests/support/reference_tree.py) on held-out prompts: the same nodes, tokens and parents (the ranking
    temperatures of a greedy and a sampled request differ, so both shapes are held to it)."""
    from service.engine.spec import tree_drafting
    from tests.support.reference_tree import top_candidate_tree

    policy = DraftPolicy(draft_length=budget, tree_width=width, draft_temperature=0)
    shapes = set()
    for prompt in heldout_prompts(6):
        seq = prefilled_sequence(engine, engine.tokenizer.encode(prompt).ids[-60:], policy, sampling)
        with torch.inference_mode():  # (as on the scheduler's thread)
            want = top_candidate_tree(engine.runtime, seq, budget)
            seq.draft_valid = 0
            got = tree_drafting.draft_trees(engine.runtime, [seq], [budget])[0].tree
        assert got == want
        shapes.add(want.parents)
    assert len(shapes) > 1 or sampling.greedy  # (a greedy tree is a chain where the calibrated head is sure)
