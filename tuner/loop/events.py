"""What the tuning loop reports while it runs: one `TunerEvent` per step worth showing.

The loop never prints; it hands events to a callback (`on_event`), so the CLI's progress lines,
the demo, the benchmarks and the tests each read the same stream and none of them reaches into the
loop's state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from service.types import DraftPolicy
from tuner.loop import study as st
from tuner.measurement.paired import PairedRatio
from tuner.measurement.window import WindowStats


class EventKind(enum.StrEnum):
    RESUMED = "resumed"
    INCUMBENT = "incumbent"
    TRIAL_STARTED = "trial_started"
    TRIAL_PROGRESS = "trial_progress"
    TRIAL_FINISHED = "trial_finished"
    CONVERGED = "converged"
    WINNER = "winner"
    WHATIF = "whatif"  # a what-if hint was enqueued, skipped, or could not be computed (message says which)


@dataclass(frozen=True)
class TunerEvent:
    kind: EventKind
    trial: int | None = None
    role: str = ""
    policy: DraftPolicy | None = None
    state: str = ""  # COMPLETE / PRUNED / FAIL for TRIAL_FINISHED
    value: float | None = None
    stats: WindowStats | None = None
    best: st.PolicyScore | None = None
    done: int = 0  # finished search trials
    total: int = 0
    message: str = ""
    paired: PairedRatio | None = None  # for TRIAL_FINISHED of a paired / interleaved trial
