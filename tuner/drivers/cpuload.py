"""A bench-owned background CPU load that switches on and off: the "machine whose speed changes".

Contract: `BackgroundLoad(seed, workers=1)` as a context manager starts a thread that alternates
on / off phases of seeded random lengths in [min_phase, max_phase] seconds. "On" runs `workers` child
processes spinning a core each; "off" kills them. Bounded three ways: the children exit by themselves
at the end of their phase (at most `max_phase` + 1 s, and never past `max_seconds`: a killed bench
leaves nothing behind for long), they are killed when
the context exits, and they do nothing but spin (no files, no network). `log` records (t, on) for
the report.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


class BackgroundLoad:
    def __init__(self, seed: int, workers: int = 1, min_phase: float = 10.0, max_phase: float = 30.0,
                 max_seconds: float = 3600.0):
        self._rng = random.Random(seed)
        self._workers = workers
        self._phase = (min_phase, max_phase)
        self._max_seconds = max_seconds
        self._stop = threading.Event()
        self._procs: list[subprocess.Popen] = []
        self._thread = threading.Thread(target=self._run, name="background-cpu-load", daemon=True)
        self._start = 0.0
        self.log: list[tuple[float, bool]] = []

    def __enter__(self) -> BackgroundLoad:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self._kill()

    @property
    def on_fraction(self) -> float:
        """Share of the elapsed time the load was on."""
        end = time.monotonic()
        on = 0.0
        for (t, state), nxt in zip(self.log, [*(t for t, _ in self.log[1:]), end - self._start], strict=True):
            on += (nxt - t) if state else 0.0
        total = end - self._start
        return on / total if total > 0 else 0.0

    def _run(self) -> None:
        on = self._rng.random() < 0.5
        while not self._stop.is_set():
            self.log.append((time.monotonic() - self._start, on))
            phase = self._rng.uniform(*self._phase)
            if on:
                # A child spins for its phase only (+1 s of slack), so a bench killed without running
                # its exit handlers leaves a spinning core behind for at most one phase.
                left = min(phase + 1.0, self._max_seconds - (time.monotonic() - self._start))
                self._procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(max(0.0, left))])
                               for _ in range(self._workers)]
            self._stop.wait(phase)
            self._kill()
            on = not on

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)
        self._procs = []
