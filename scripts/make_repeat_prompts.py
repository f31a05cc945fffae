"""Build service/prompts/repeat.jsonl: prompts whose natural continuation repeats the prompt.

Provenance: derived only from the shipped held-out prompts (service/prompts/heldout.jsonl, cut from
held-out CPython files, see service/models/MODEL_CARD.md). For each of the first 16 held-out prompts,
its last 6 non-empty lines form a block B; the prompt is B, B again, then the first half of B's lines:
a file that pastes the same block over and over (generated tables, repeated test cases, log-like
output). The answer the text asks for is the rest of B, so prompt lookup (the n-gram drafter) finds
long exact matches and acceptance rises far above the plain code prompts': the workload-shift
benchmark's second workload. Deterministic: rerun to reproduce the committed file byte for byte.

    python scripts/make_repeat_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "service" / "prompts" / "heldout.jsonl"
TARGET = ROOT / "service" / "prompts" / "repeat.jsonl"
COUNT, BLOCK_LINES = 16, 6


def repeat_prompt(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()][-BLOCK_LINES:]
    block = "\n".join(lines) + "\n"
    return block + block + "\n".join(lines[: len(lines) // 2]) + "\n"


def main() -> None:
    rows = [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()][:COUNT]
    out = [json.dumps({"id": r["id"], "source": f"heldout.jsonl id {r['id']} ({r['source']}), last "
                       f"{BLOCK_LINES} lines x 2.5", "prompt": repeat_prompt(r["prompt"])}) for r in rows]
    TARGET.write_text("\n".join(out) + "\n")
    print(f"wrote {len(out)} prompts to {TARGET}")


if __name__ == "__main__":
    main()
