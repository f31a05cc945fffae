"""What every training stage shares: the corpus, its split, batches, the learning-rate schedule and
the cumulative report of resumed runs."""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer

EOS = "<|endoftext|>"


def corpus_files(heldout_every: int = 25) -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    train, heldout = [], []
    for p in files:
        digest = int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16)
        (heldout if digest % heldout_every == 0 else train).append(p)
    return train, heldout


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def encode(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([read(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batch(data: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - length - 1, (size,), generator=gen)
    return torch.stack([data[s:s + length + 1] for s in starts.tolist()])  # [B, T+1]


def lr_at(step_frac: float, peak: float, warm: float = 0.03) -> float:
    if step_frac < warm:
        return peak * step_frac / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step_frac - warm) / (1 - warm)))))


def combine(previous: dict | None, run: dict) -> dict:
    """Cumulative figures over a resumed model's runs; each run kept under "runs"."""
    if not previous:
        return {**run, "runs": [run]}
    runs = previous.get("runs", [previous]) + [run]
    total = {k: sum(r[k] for r in runs) for k in ("steps", "tokens")}
    total["minutes"] = round(sum(r["minutes"] for r in runs), 1)
    return {**run, **total, "peak_lr": "/".join(str(r["peak_lr"]) for r in runs), "runs": runs}
