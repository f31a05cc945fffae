"""Draft trees with the EAGLE-3 draft (service/engine/spec/eagle3_trees.py): greedy output is plain
decoding's for trees of lengths 1-4 (and wider and longer ones), a one-token prompt included; sampled
output follows the target's joint law of the first two tokens (top candidates and sampled branches);
and the top-candidate tree is the budget best paths by score, found by brute force through the draft's
chain path (`Eagle3Draft.forward_ragged`, not the tree's own node entries)."""

from __future__ import annotations

import pytest
import torch

from service.engine.model.ragged import RaggedBatch
from service.types import DraftPolicy, GenerationRequest, SamplingParams
from tests.engine.spec.test_eagle3_lossless import (  # noqa: F401 (fixtures)
    EAGLE3_DIR,
    engine,
    plain_outputs,
    spread_law,
    spread_prompt,
)
from tests.engine.spec.test_speculative_lossless import ALPHA, E2E_REQUESTS, SAMPLING
from tests.support.engine_helpers import first_tree_steps, heldout_prompts, prefilled_sequence

GREEDY = SamplingParams(temperature=0)
SHAPES = [(1, 2), (2, 2), (3, 2), (4, 2), (4, 3), (8, 4)]  # (node budget, width); one node is a chain


def test_the_eagle3_engine_offers_trees_ranked_at_the_temperature_its_directory_records(engine):  # noqa: F811
    """The fit at load (tree_calibration.py) is what service/models/eagle3/tree_ranking.json records for
    the SGLang backend, which cannot run the fit (rounded there to two digits)."""
    import json

    assert engine.runtime.draft_is_eagle3
    assert engine.info.max_tree_width == 4 and "tree_width" in engine.info.tunable
    recorded = json.loads((EAGLE3_DIR / "tree_ranking.json").read_text())["greedy_temperature"]
    assert engine.runtime.tree_greedy_tau == pytest.approx(recorded, abs=0.01)


@pytest.mark.parametrize("budget,width", SHAPES)
def test_greedy_eagle3_trees_give_the_plain_decoding_output(engine, plain_outputs, budget, width):  # noqa: F811
    branched = 0
    for temperature in (0.0, 1.0):  # top candidates, sampled branches
        policy = DraftPolicy(draft_length=budget, tree_width=width, draft_temperature=temperature)
        for prompt, plain in plain_outputs:
            result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, sampling=GREEDY), policy)
            assert result.token_ids == plain.token_ids
            assert result.spec.drafted_tokens > 0 and result.spec.tree_width == width
            for step in (s for s in result.steps if s.tree_parents):
                on_path = [i for i, ok in enumerate(step.accepted_per_position) if ok]
                assert len(on_path) == step.accepted
                assert all(step.tree_parents[b] == a for a, b in zip([-1, *on_path], on_path, strict=False))
                branched += step.branches > 1
    assert branched > 0 or budget == 1  # sampled branches always branch at the root


def test_a_one_token_prompt_grows_its_first_tree_from_its_second_step(engine):  # noqa: F811
    plain = engine.generate(GenerationRequest(prompt_token_ids=(17,), max_new_tokens=12, sampling=GREEDY),
                            DraftPolicy())
    tree = engine.generate(GenerationRequest(prompt_token_ids=(17,), max_new_tokens=12, sampling=GREEDY),
                           DraftPolicy(draft_length=4, tree_width=2, draft_temperature=0))
    assert tree.token_ids == plain.token_ids
    assert tree.steps[0].drafted == 0 and tree.spec.drafted_tokens > 0


@pytest.mark.slow  # 400 seeded requests per shape
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["top-candidates", "sampled-branches"])
def test_sampled_eagle3_trees_give_the_target_joint_law_of_the_first_two_tokens(engine, spread_prompt,  # noqa: F811
                                                                               spread_law, temperature):  # noqa: F811
    """Each request's first step verifies a tree of 3 nodes (4 new tokens leave room): the first two
    committed tokens follow p(t1) p(t2 | t1) whichever branch gave them."""
    tree = DraftPolicy(draft_length=3, tree_width=2, draft_temperature=temperature)
    outputs, first_steps = first_tree_steps(engine, spread_prompt[0], tree, SAMPLING, E2E_REQUESTS)
    assert all(s.tree_parents.count(-1) >= 2 for s in first_steps[:20]), "the root should have two children"
    assert sum(1 for s in first_steps if s.accepted and not s.accepted_per_position[0]) >= 5  # a sibling taken
    assert spread_law.pvalue(outputs) > ALPHA


def brute_force_best_paths(rt, seq, logits: torch.Tensor, hidden: torch.Tensor, budget: int,
                           width: int) -> tuple[set[tuple[int, ...]], dict[tuple[int, ...], torch.Tensor]]:
    """Every path of the width likeliest children, to depth `budget`, scored by its log-probability at the
    greedy tau; each path's entries run as a chain (`forward_ragged`, rows from the root's on, rewritten
    depth first). Returns the budget best paths as token tuples, and each expanded path's draft logits."""
    draft, embed, cache = rt.draft, rt.target.embed_tokens, rt.draft_cache
    target_ids, position = draft.target_ids, len(seq.ids) - 1
    scored: dict[tuple[int, ...], float] = {}
    expanded: dict[tuple[int, ...], torch.Tensor] = {}

    def grow(path: tuple[int, ...], score: float, node_logits: torch.Tensor, node_hidden: torch.Tensor) -> None:
        top = torch.log_softmax(node_logits.float() / rt.tree_greedy_tau, dim=-1).topk(width)
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            child = (*path, index)
            scored[child] = score + value
            if len(child) < budget:
                batch = RaggedBatch.build([seq.slot], [position + len(path)], [1])
                out_logits, out_hidden = draft.forward_ragged(embed(target_ids[index:index + 1]), node_hidden[None],
                                                              batch, cache, torch.zeros(1, dtype=torch.long))
                expanded[tuple(target_ids[list(child)].tolist())] = out_logits[0]
                grow(child, score + value, out_logits[0], out_hidden[0])

    grow((), 0.0, logits, hidden)
    best = sorted(scored, key=lambda p: -scored[p])[:budget]
    return {tuple(target_ids[list(p)].tolist()) for p in best}, expanded


@pytest.mark.parametrize("budget,width", [(4, 2), (5, 3)])
def test_the_top_candidate_tree_is_the_best_paths_by_score(engine, monkeypatch, budget, width):  # noqa: F811
    """The tree's nodes are the brute force's best paths, and every node the tree expanded read what a
    chain along its path reads (its draft logits against the brute force's for that path)."""
    from service.engine.spec import eagle3_trees
    from service.engine.spec.eagle3_drafting import catch_up

    policy = DraftPolicy(draft_length=budget, tree_width=width, draft_temperature=0)
    shapes = set()
    for prompt in heldout_prompts(6):
        seq = prefilled_sequence(engine, engine.tokenizer.encode(prompt).ids[-60:], policy, GREEDY)
        node_logits: list[torch.Tensor] = []  # what each forward_node call gave: node i's (expanded in order)

        def recording(*args, forward_node=engine.runtime.draft.forward_node, out=node_logits):
            logits, hidden = forward_node(*args)
            out.append(logits.clone())
            return logits, hidden

        with torch.inference_mode():
            root = catch_up(engine.runtime, [seq])[0]
            with monkeypatch.context() as patch:
                patch.setattr(engine.runtime.draft, "forward_node", recording)
                tree = eagle3_trees.top_candidate_tree(engine.runtime, seq, *root, budget)
            want, chain_logits = brute_force_best_paths(engine.runtime, seq, *root, budget, width)
        paths = []
        for node in range(len(tree.tokens)):
            path, i = [], node
            while i >= 0:
                path.append(tree.tokens[i])
                i = tree.parents[i]
            paths.append(tuple(reversed(path)))
        assert set(paths) == want
        assert len(node_logits) == budget - 1  # every node but the last taken was expanded
        for path, logits in zip(paths, node_logits, strict=False):
            torch.testing.assert_close(logits, chain_logits[path], rtol=0, atol=1e-4)
        shapes.add(tree.parents)
    assert len(shapes) > 1  # not one shape for every prompt (chains only would not test the ranking)


def test_a_node_reads_what_a_chain_along_its_path_reads_and_nothing_of_its_siblings(engine):  # noqa: F811
    """Root children a (row r) and b (row r + 1), and c, b's child (row r + 2): b's and c's draft logits
    through `forward_node` equal those of the chains [b] and [b, c] run through `forward_ragged`."""
    from service.engine.spec.eagle3_drafting import catch_up

    rt = engine.runtime
    draft, embed, cache = rt.draft, rt.target.embed_tokens, rt.draft_cache
    ids = engine.tokenizer.encode(heldout_prompts(1)[0]).ids[-40:]
    seq = prefilled_sequence(engine, ids, DraftPolicy(draft_length=3, tree_width=2, draft_temperature=0), GREEDY)
    r = len(ids) - 1  # the first row past the true entries 0..n-2
    with torch.inference_mode():
        logits, hidden = catch_up(rt, [seq])[0]
        a, b = logits.topk(2).indices.tolist()
        prefix = list(range(r))

        def node(index: int, parent_hidden, row: int, position: int, path: list[int]):
            return draft.forward_node(embed(draft.target_ids[index]), parent_hidden, cache, 0, row, position,
                                      torch.tensor(prefix + path))

        node(a, hidden, r, r, [r])
        b_logits, b_hidden = node(b, hidden, r + 1, r, [r + 1])
        c = int(b_logits.argmax())
        c_logits, _ = node(c, b_hidden, r + 2, r + 1, [r + 1, r + 2])

        def chain_entry(index: int, parent_hidden, position: int):
            out = draft.forward_ragged(embed(draft.target_ids[index:index + 1]), parent_hidden[None],
                                       RaggedBatch.build([0], [position], [1]), cache, torch.zeros(1, dtype=torch.long))
            return out[0][0], out[1][0]

        chain_b_logits, chain_b_hidden = chain_entry(b, hidden, r)
        chain_c_logits, _ = chain_entry(c, chain_b_hidden, r + 1)
    torch.testing.assert_close(b_logits, chain_b_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(c_logits, chain_c_logits, rtol=0, atol=1e-4)
