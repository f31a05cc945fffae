"""The walk of a k'-run over one request's recorded positions: which steps it would take, where each
starts and how many tokens it drafts.

Each output position carries the acceptance outcome the recorded run observed there (1 accepted,
0 rejected / nothing to propose); windows of k' drafts are walked over them, each step committing
its accepted drafts plus one token. The one position a fully accepted step never tested (its bonus
token) is drawn with the run's own P(accept | previous accepted). The walk keeps the correlation
between neighbouring steps that treating recorded steps as independent loses: a k'-run cuts a long
accepted run short and starts its next step inside it, where acceptance is high. What it cannot
know is how the drafter would behave at a step start the run never had (the n-gram drafter's
lookup, the draft model's catch-up), so it is exact only for position-wise deterministic drafters
(model drafter at temperature 0 with greedy requests).

A walked step starting at output position p drafts min(k', offer(p)) tokens: at a recorded step
start the recorded count; inside a recorded step's accepted run, for the model drafter k, for the
n-gram drafter the recorded count (the lookup keeps matching the same earlier span, which offers
as many tokens as before), never past the request's token budget (its last token is always a plain
step). Pricing the walked steps is `service.whatif.predict`'s job.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from service.types import Drafter, StepRecord


def position_outcomes(request: Sequence[StepRecord]) -> list[int | None]:
    """One request's output positions: 1 = a draft was accepted there, 0 = rejected or nothing to
    propose, None = never tested (the bonus token after a fully accepted window of k drafts)."""
    out: list[int | None] = []
    for s in request:
        a, d = s.accepted, s.drafted
        if s.committed <= a:  # EOS inside the accepted drafts ended the request
            out += [1] * s.committed
        elif a < d or d < s.draft_length or s.draft_length == 0:
            out += [1] * a + [0]  # rejected at a, or the drafter had nothing more to offer
        else:
            out += [1] * a + [None]
    return out


def position_steps(request: Sequence[StepRecord]) -> list[tuple[int, int]]:
    """Aligned with `position_outcomes`: for each output position, (the recorded step that committed
    it, its offset in that step), i.e. where a step starting there finds its window's positions in
    the recorded window (offset 0 = the recorded step's own start)."""
    out: list[tuple[int, int]] = []
    for g, s in enumerate(request):
        out += [(g, i) for i in range(min(s.committed, s.accepted + 1))]
    return out


def position_offers(request: Sequence[StepRecord], places: Sequence[tuple[int, int]]) -> list[int]:
    """Drafts the drafter would offer at a step starting at each output position (before the k'
    cap): the recorded count at a recorded start; inside a recorded accepted run the model drafter
    offers k, the n-gram lookup the recorded count (it keeps matching the same earlier span); never
    past the budget (the request's last position is always a plain step)."""
    n = len(places)
    offers = []
    for p, (g, i) in enumerate(places):
        s = request[g]
        if i == 0:
            offers.append(s.drafted)
        else:
            inside = s.draft_length if s.drafter is Drafter.MODEL else s.drafted
            offers.append(max(0, min(inside, n - p - 1)))
    return offers


def position_drafts(request: Sequence[StepRecord], places: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether a step starting at each output position runs its drafter at all (a model pass, an
    n-gram lookup): as recorded at a recorded start, else while the budget leaves room for a draft."""
    n = len(places)
    return [request[g].drafted > 0 or request[g].draft_seconds > 0 if i == 0 else n - p - 1 > 0
            for p, (g, i) in enumerate(places)]


def continue_probability(requests: Sequence[list[int | None]]) -> float:
    """P(accepted | the previous position accepted), over positions the run tested."""
    pairs = [(x, y) for r in requests for x, y in zip(r, r[1:], strict=False) if x == 1 and y is not None]
    return sum(y for _, y in pairs) / len(pairs) if pairs else 0.0


def replay_steps(outcomes: Sequence[int | None], offers: Sequence[int], k: int, p_continue: float,
                 rng: random.Random) -> list[tuple[int, int]]:
    """Windows of up to k drafts over one request's positions -> (start position, drafts) per step;
    each step commits its accepted drafts plus one token, so the steps cover every position."""
    n, p, steps = len(outcomes), 0, []
    while p < n:
        d = min(k, offers[p])
        j = 0
        while j < d and p + j < n:
            o = outcomes[p + j]
            if o is None:
                o = int(rng.random() < p_continue)
            if not o:
                break
            j += 1
        steps.append((p, d))
        p += j + 1
    return steps
