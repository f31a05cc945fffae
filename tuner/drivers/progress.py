"""Human-readable progress lines for tuner events (the CLI's and the demo's live view).

One line per trial start/finish and per incumbent change; while a window fills, a single line is
rewritten in place when the stream is a terminal (never into a log file).
"""

from __future__ import annotations

from typing import TextIO

from tuner.loop.events import EventKind, TunerEvent
from tuner.loop.space import policy_key


def fmt_cost(value: float | None, objective: str) -> str:
    if value is None:
        return "-"
    if objective == "modelled":
        return f"{value / 1e6:.3f} MB/tok"
    return f"{value * 1e3:.3f} ms/tok"


class ProgressPrinter:
    def __init__(self, stream: TextIO, objective: str = "measured", live: bool | None = None):
        self._out = stream
        self._objective = objective
        self._live = stream.isatty() if live is None else live
        self._last_incumbent: str | None = None
        self._open_line = False

    def __call__(self, e: TunerEvent) -> None:
        if e.kind is EventKind.TRIAL_PROGRESS:
            if self._live and e.stats is not None:
                running = e.stats.seconds_per_token if self._objective == "measured" else None
                self._write(f"\r  trial {e.trial}: {e.stats.requests} req, {e.stats.committed} tok, "
                            f"running {fmt_cost(running, self._objective)}   ", end="")
            return
        text = self.line(e)
        if text:
            self._write(("\n" if self._open_line else "") + text)

    def line(self, e: TunerEvent) -> str | None:
        best = f"best {e.best.key.label()} {fmt_cost(e.best.mean, self._objective)}" if e.best else "best -"
        if e.kind is EventKind.RESUMED:
            return f"tuner: {e.message}; {e.done}/{e.total} search trials done"
        if e.kind is EventKind.TRIAL_STARTED:
            tag = {"remeasure": "re-measure", "challenge": "challenge"}.get(e.role, f"{e.done + 1}/{e.total}")
            return f"trial {e.trial} [{tag}] {policy_key(e.policy).label()} ({e.policy.policy_id}) ... {best}"
        if e.kind is EventKind.TRIAL_FINISHED:
            stats = ""
            if e.stats is not None:
                stats = (f" {e.stats.requests} req {e.stats.committed} tok acc {e.stats.acceptance_rate:.2f}"
                         f" unique/layer {','.join(f'{x:.0f}' for x in e.stats.unique_experts_mean)}")
            reason = f" ({e.message})" if e.message else ""
            paired = ""
            if e.paired is not None and e.paired.ratio == e.paired.ratio:  # not NaN
                paired = f" = {e.paired.ratio:.3f}x control [{e.paired.low:.3f}, {e.paired.high:.3f}]"
            return f"trial {e.trial} {e.state} {fmt_cost(e.value, self._objective)}{paired}{stats}{reason}"
        if e.kind is EventKind.WHATIF:
            return f"trial {e.trial} what-if: {e.message}"
        if e.kind is EventKind.CONVERGED:
            return f"search converged after {e.done} measured trials: {e.message}"
        if e.kind is EventKind.INCUMBENT:
            label = e.best.key.label() if e.best else ""
            if label == self._last_incumbent:
                return None  # re-applied, unchanged: not news
            self._last_incumbent = label
            return f"incumbent -> {label} {fmt_cost(e.value, self._objective)} ({e.policy.policy_id})"
        if e.kind is EventKind.WINNER:
            vals = ", ".join(fmt_cost(v, self._objective) for v in e.best.values)
            return f"winner: {e.best.key.label()} mean {fmt_cost(e.value, self._objective)} over [{vals}] " \
                   f"applied as {e.policy.policy_id}"
        return None

    def _write(self, text: str, end: str = "\n") -> None:
        self._out.write(text + end)
        self._out.flush()
        self._open_line = end == ""
