"""The controller interface: what the scheduler asks a request's controller at each step.

Per step and request: `plan` (how many drafts to draft, before drafting), `cut` (of the drafts
made, how many to verify, from the draft side's own confidences), `observe` (the verify outcome).
A controller shared by several requests (SGLang's rule decides per batch) also hears `end_pass`.

Why the rules stay lossless: a step's drafts are verified by the usual acceptance rule, and which
drafts reach the verifier depends only on what was known before each of them was drawn: past
verify outcomes and timings, and for draft i the drafts before it and its distribution's largest
probability (fixed before draft i is drawn). Keeping or dropping draft i by its own sampled value
would bias sampled output; nothing here does (`cut` keeps a prefix decided position by position
from that information). Greedy requests are exact-match and lossless for any cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class StepContext(NamedTuple):
    """What a controller knows about the step it plans. (Tuples: every request's step builds one,
    and a frozen dataclass costs several times as much to build.)"""

    batch_size: int  # sequences in the pass
    other_positions: int  # positions the pass's other windows are expected to hold (the last pass's)
    draft_lag: int = 0  # tokens the request's model-drafter cache lacks: its first draft round feeds them


@dataclass(frozen=True)
class DraftConfidence:
    """The draft side's confidences of one step's drafts, position by position."""

    token: tuple[float, ...]  # the draft distribution's probability of the token it drafted
    top: tuple[float, ...]  # the draft distribution's largest probability (known before the draw)


class StepOutcome(NamedTuple):
    drafted: int  # drafts verified
    accepted: int  # the verifier's accepted prefix
    seconds: float  # the step's draft + verify seconds (the whole pass's, when batched)
    committed: int  # accepted + the target's token
    confidence: DraftConfidence | None  # of the verified drafts, where the drafter gives them
    # drafts the controller asked for (after its cut): more than `drafted` where the n-gram drafter
    # found fewer, or no match at all (a lookup paid for, nothing to verify)
    planned: int = 0


class StepController:
    """The static policy: every step drafts what the budget allows; the base of the adaptive ones."""

    wants_confidence = False  # ask the drafter for DraftConfidence (costs a softmax per draft)
    shared = False  # one object for every request of a policy (hears end_pass once per pass)
    hears_plain_steps = True  # observe() is called for steps that verified no draft too

    def plan(self, ctx: StepContext, limit: int) -> int:
        """Drafts to draft this step, in [0, limit] (limit: the policy's length cut to the budget)."""
        return limit

    def cut(self, confidence: DraftConfidence) -> int:
        """Of the drafts drafted, how many to verify (a prefix); all of them by default."""
        return len(confidence.top)

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def expected_accepted(self, drafted: int) -> float | None:
        """The expected accepted drafts of this step's first `drafted` drafts (those verified), where
        the controller predicts them."""
        return None

    def end_pass(self, batch_size: int) -> None:
        pass


def adapts(controller: StepController) -> bool:
    """Anything but the static policy's base: its requests feed the engine's estimates."""
    return type(controller) is not StepController
