"""Per-position acceptance recounted from tokens alone, for the tests that check both backends' step
records against it (never from a backend's own flags)."""

from __future__ import annotations

from service.types import StepRecord


def recount(drafts: list[int], committed: list[int]) -> tuple[bool, ...]:
    """Per drafted position: accepted iff it and every draft before it equal the token committed there.

    A step commits its accepted drafts and then the target's own token, which differs from the first
    rejected draft (greedy: it is the argmax the draft missed; sampled: the residual has no mass on
    the rejected token), so the matching prefix is exactly the accepted run."""
    out, run = [], True
    for i, token in enumerate(drafts):
        run = run and i < len(committed) and committed[i] == token
        out.append(run)
    return tuple(out)


def committed_per_step(steps: tuple[StepRecord, ...], token_ids: tuple[int, ...], skip: int = 0) -> list[list[int]]:
    """The output tokens each step committed, in order (`skip`: leading tokens no step committed)."""
    out, at = [], skip
    for s in steps:
        out.append(list(token_ids[at:at + s.committed]))
        at += s.committed
    assert at == len(token_ids), "the steps' committed counts must cover the output"
    return out


def per_position_totals(flags: list[tuple[bool, ...]], k: int) -> tuple[int, ...]:
    return tuple(sum(int(f[i]) for f in flags if i < len(f)) for i in range(k))
