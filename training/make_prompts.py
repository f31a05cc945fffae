"""Cut the shipped prompt set from the held-out files (never seen in training).

Each prompt is the code just before a `def` line plus that line, so the natural continuation is a
function body. Writes service/prompts/heldout.jsonl.
"""

from __future__ import annotations

import json
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.common import corpus_files, read  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "service" / "prompts" / "heldout.jsonl"


def main(count: int = 64, context_lines: int = 12, seed: int = 0) -> None:
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    _, heldout = corpus_files()
    candidates = []
    for path in heldout:
        lines = read(path).splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= context_lines:
                candidates.append((path, i, "".join(lines[i - context_lines:i + 1])))
    picked = rng.sample(candidates, min(count, len(candidates)))
    picked.sort(key=lambda c: (str(c[0]), c[1]))
    with OUT.open("w") as f:
        for n, (path, line, prompt) in enumerate(picked):
            record = {"id": n, "source": f"{path.relative_to(root)}:{line + 1}", "prompt": prompt}
            f.write(json.dumps(record) + "\n")
    print(f"wrote {len(picked)} prompts from {len(heldout)} held-out files to {OUT}")


if __name__ == "__main__":
    main()
