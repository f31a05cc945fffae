"""`StepClock`, the unit of decode_step_equivalents: the calibrated step until 8 plain steps are seen,
then the median of the recent ones, equal to statistics.median over the window at every step (the
clock keeps them sorted instead of sorting every step)."""

from __future__ import annotations

import random
import statistics

from service.engine.runtime import StepClock


def test_the_unit_is_the_calibration_then_the_median_of_the_recent_plain_steps():
    clock, recent, rng = StepClock(0.5, recent=16), [], random.Random(0)
    for i in range(200):
        assert clock.decode_step_seconds() == (0.5 if len(recent) < 8 else statistics.median(recent[-16:])), i
        seconds = rng.choice([rng.random(), 0.25, 0.75])  # repeats too: eviction must drop one copy
        clock.observe_plain_step(seconds)
        recent.append(seconds)
