"""What the continuous tuner's exploration costs: measured round by round, then projected onto the
schedule the CLI runs.

Why not "throughput with the tuner on vs off in alternating periods" (the first version): each
restart reset the tuner's back-off, so every exploring period opened with a challenge round and a
20-s period measured little but rounds (median 13%, range 1.6-44%), while the steady state the
issue asks about has rounds minutes apart. Here the tuner runs without restarts and a fixed gap
between rounds; the load's output tokens are sampled throughout, and the gaps (the incumbent serving
alone) on both sides of each round are that round's reference, so drift slower than a round cancels.

Per round i (monotonic start s_i, end e_i, after the incumbent was put back):
  alone rate r_i = tokens / seconds over the gaps before and after it, each gap starting `settle`
      seconds after the previous round ended (requests still in flight under the challenger's
      policy finish there);
  lost seconds l_i = (e_i - s_i) - tokens in [s_i, e_i] / r_i: incumbent time the round cost
      (the challenger's slower windows, the policy switches, any window the tuner waited out).
A round during which the incumbent changed is not used (its two gaps ran different policies).
The cost at a spacing S between rounds is l / (round + S) of the incumbent's throughput:
- measured: sum l / sum (round + gap) over the rounds as they ran (the bench's fixed gap);
- steady state: at the CLI's spacing once nothing changes, max(max_idle_seconds, idle floor);
- first hour after a decision: the CLI's back-off (idle_seconds doubling to max_idle_seconds).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    start: float
    end: float
    floor: float  # the idle the tuner must wait after it (a challenger with all the traffic)
    incumbent_changed: bool = False


@dataclass(frozen=True)
class RoundCost:
    seconds: float
    lost_seconds: float
    alone_tokens_per_second: float
    used: bool

    def as_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 2), "lost_seconds": round(self.lost_seconds, 2),
                "alone_tokens_per_second": round(self.alone_tokens_per_second, 1), "used": self.used}


class TokenTrace:
    """Cumulative output tokens sampled at monotonic times; linear between samples."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[float] = []

    def add(self, t: float, tokens: float) -> None:
        self.times.append(t)
        self.tokens.append(tokens)

    def at(self, t: float) -> float:
        i = bisect.bisect_left(self.times, t)
        if i <= 0:
            return self.tokens[0]
        if i >= len(self.times):
            return self.tokens[-1]
        t0, t1 = self.times[i - 1], self.times[i]
        return self.tokens[i - 1] + (self.tokens[i] - self.tokens[i - 1]) * (t - t0) / (t1 - t0)

    def between(self, a: float, b: float) -> float:
        return self.at(b) - self.at(a)


def round_costs(trace: TokenTrace, rounds: list[Round], first_gap_start: float, last_gap_end: float,
                settle: float = 1.0) -> list[RoundCost]:
    """Each round's lost seconds against the gaps around it (module docstring)."""
    out = []
    for i, r in enumerate(rounds):
        before = (rounds[i - 1].end + settle if i else first_gap_start, r.start)
        after = (r.end + settle, rounds[i + 1].start if i + 1 < len(rounds) else last_gap_end)
        gaps = [(a, b) for a, b in (before, after) if b > a]
        gap_seconds = sum(b - a for a, b in gaps)
        rate = sum(trace.between(a, b) for a, b in gaps) / gap_seconds if gap_seconds > 0 else 0.0
        seconds = r.end - r.start
        lost = seconds - trace.between(r.start, r.end) / rate if rate > 0 else float("nan")
        out.append(RoundCost(seconds, lost, rate, used=rate > 0 and not r.incumbent_changed))
    return out


def back_off_rounds(horizon: float, round_seconds: float, floor: float, idle: float, max_idle: float) -> int:
    """Rounds the CLI's continuous mode runs in `horizon` seconds after a decision when nothing
    changes: a round, then max(idle, floor) alone, the idle doubling up to max_idle."""
    t, n = 0.0, 0
    while t + round_seconds <= horizon:
        n += 1
        t += round_seconds + max(idle, floor)
        idle = min(max_idle, idle * 2)
    return n


def summarize(costs: list[RoundCost], rounds: list[Round], idle_seconds: float, max_idle_seconds: float) -> dict:
    """Measured cost over the rounds as they ran, and the projections onto the CLI's schedule."""
    used = [(c, r) for c, r in zip(costs, rounds, strict=True) if c.used]
    summary: dict[str, object] = {"rounds": [c.as_dict() for c in costs], "used_rounds": len(used)}
    if not used:
        return summary
    lost = statistics.median(c.lost_seconds for c, _ in used)
    seconds = statistics.median(c.seconds for c, _ in used)
    floor = statistics.median(r.floor for _, r in used)
    # A used round that has a next one: its cycle runs from its start to the next round's start.
    pairs = zip(costs[:-1], rounds[:-1], rounds[1:], strict=True)
    cycles = [(c.lost_seconds, nxt.start - r.start) for c, r, nxt in pairs if c.used]
    measured_lost, measured_cycle = sum(lost for lost, _ in cycles), sum(cycle for _, cycle in cycles)
    steady_spacing = max(max_idle_seconds, floor)
    hour = back_off_rounds(3600.0, seconds, floor, idle_seconds, max_idle_seconds)
    summary.update({
        "lost_seconds_per_round_median": round(lost, 2),
        "lost_seconds_per_round_min": round(min(c.lost_seconds for c, _ in used), 2),
        "lost_seconds_per_round_max": round(max(c.lost_seconds for c, _ in used), 2),
        "round_seconds_median": round(seconds, 2),
        "idle_floor_seconds_median": round(floor, 2),
        "measured_cost_percent": round(100 * measured_lost / measured_cycle, 2) if measured_cycle else None,
        "steady_spacing_seconds": steady_spacing,
        "steady_cost_percent": round(100 * lost / (seconds + steady_spacing), 2),
        "first_hour_rounds": hour,
        "first_hour_cost_percent": round(100 * hour * lost / 3600.0, 2),
    })
    return summary
