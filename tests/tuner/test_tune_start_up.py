"""`moespec tune` starts without torch: every fleet worker pays its imports at start-up, and torch
is only needed for what-if predictions over an expert-parallel placement, never by the tuning loop."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_tuner_command_does_not_import_torch():
    probe = ("import sys, service.cli.tune; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"service.cli.tune imports torch: {done.stdout.strip()[:200]}"
