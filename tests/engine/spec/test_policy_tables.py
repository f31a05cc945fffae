"""Table policies (DraftPolicy.cells): each step runs the cell that matches its pass's occupancy and
its request's kind, through `Engine.generate`; requests whose occupancy moves switch cells (and
drafters) mid-request and still give the plain greedy output."""

from __future__ import annotations

import threading

import pytest

from service.policy.ids import derived_id
from service.types import (
    Drafter,
    DraftPolicy,
    GenerationRequest,
    InvalidRequest,
    PolicyCell,
    RequestKind,
    SamplingParams,
)
from tests.support.engine_helpers import heldout_prompts, make_engine

GREEDY, SAMPLED = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95)
TABLE = DraftPolicy(policy_id="table", cells=(
    PolicyCell(DraftPolicy(Drafter.NGRAM, 4), max_batch=1, kind=RequestKind.GREEDY),
    PolicyCell(DraftPolicy(Drafter.NGRAM, 2), max_batch=1, kind=RequestKind.SAMPLED),
    PolicyCell(DraftPolicy(Drafter.MODEL, 3, 0.0), min_batch=2, max_batch=3),
))  # 4 and more requests: the base, plain


def expected_cell(policy: DraftPolicy, batch_size: int, greedy: bool) -> tuple[str, DraftPolicy]:
    """The reference lookup, written from the cells' documented meaning."""
    for cell in policy.cells:
        upper = cell.max_batch or batch_size
        kind_ok = cell.kind is RequestKind.ANY or cell.kind is (RequestKind.GREEDY if greedy else RequestKind.SAMPLED)
        if cell.min_batch <= batch_size <= upper and kind_ok:
            return cell.label, cell.policy
    return "", policy


def test_the_lookup_matches_the_cells_meaning_at_every_occupancy_and_kind():
    for batch_size in range(1, 20):
        for greedy in (True, False):
            index, policy = TABLE.for_step(batch_size, greedy)
            label, expected = expected_cell(TABLE, batch_size, greedy)
            assert policy == expected and (TABLE.cells[index].label if index >= 0 else "") == label


def test_labels_ids_and_overlaps():
    assert [c.label for c in TABLE.cells] == ["b1-1.greedy", "b1-1.sampled", "b2-3.any"]
    assert derived_id(TABLE) == "plain+b1-1.greedy=ngram-k4+b1-1.sampled=ngram-k2+b2-3.any=model-k3-t0"
    assert TABLE.longest_draft == 4 and TABLE.drafters == {Drafter.NGRAM, Drafter.MODEL}
    greedy_small = PolicyCell(DraftPolicy(), max_batch=4, kind=RequestKind.GREEDY)
    assert not greedy_small.overlaps(PolicyCell(DraftPolicy(), max_batch=4, kind=RequestKind.SAMPLED))
    assert not greedy_small.overlaps(PolicyCell(DraftPolicy(), min_batch=5))
    assert greedy_small.overlaps(PolicyCell(DraftPolicy(), min_batch=4))  # batch 4, greedy: both
    with pytest.raises(InvalidRequest, match=r"overlaps cells\[0\]") as e:
        DraftPolicy(cells=(greedy_small, PolicyCell(DraftPolicy(), min_batch=2, max_batch=2))).validate()
    assert e.value.field == "policy.cells[1]"


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def test_each_step_runs_its_context_cell_and_greedy_output_stays_plain(engine):
    """Six requests of different lengths, half greedy: occupancy falls from 6 to 1 as they finish, so
    requests cross from the base (plain) to the model cell to the n-gram cells."""
    prompts = heldout_prompts(3)
    jobs = [(prompts[i % 3], 16 + 12 * i, GREEDY if i % 2 == 0 else SAMPLED) for i in range(6)]
    plain = {i: engine.generate(GenerationRequest(prompt=p, max_new_tokens=n, sampling=GREEDY), DraftPolicy())
             for i, (p, n, s) in enumerate(jobs) if s is GREEDY}
    results = {}

    def run(i: int) -> None:
        prompt, n, sampling = jobs[i]
        results[i] = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=n, sampling=sampling), TABLE)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen, switched = set(), 0
    for i, result in results.items():
        greedy = jobs[i][2] is GREEDY
        cells = set()
        for step in result.steps:
            label, policy = expected_cell(TABLE, step.batch.batch_size, greedy)
            assert (step.cell, step.drafter if policy.draft_length else None, step.draft_length) == (
                label, policy.drafter if policy.draft_length else None, policy.draft_length), (i, step.batch.batch_size)
            assert step.drafted <= policy.draft_length and step.policy_id == "table"
            cells.add(label)
        seen |= cells
        switched += len(cells) > 1
        if greedy:
            assert result.token_ids == plain[i].token_ids, i
    assert switched >= 3, seen  # requests did change cells mid-request
    assert {"b2-3.any", ""} <= seen and seen & {"b1-1.greedy", "b1-1.sampled"}, seen
