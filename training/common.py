"""What every training stage shares: the corpus, its split, batches, the learning-rate schedule and
the cumulative report of resumed runs."""

from __future__ import annotations

import hashlib
import math
import sysconfig
import time
from collections.abc import Callable
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


def train_for(module: torch.nn.Module, minutes: float, peak_lr: float, weight_decay: float,
              loss_of_batch: Callable[[], tuple[torch.Tensor, str]], save: Callable[[], None], name: str,
              log_every: int, tokens_per_step: int, batch_size: int, seq: int) -> dict:
    """The wall-clock training loop every stage shares: AdamW on `module`'s parameters under `lr_at`'s
    schedule, gradient clipping at 1, a log line every `log_every` steps (loss_of_batch returns the loss
    and what to print), a save every 5 minutes and at the end. Returns the run's report."""
    opt = torch.optim.AdamW(module.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    budget, t0, step, last_save = minutes * 60, time.time(), 0, time.time()
    module.train()
    while (elapsed := time.time() - t0) < budget:
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / budget, peak_lr)
        loss, line = loss_of_batch()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0:
            print(f"[{name}] step {step} {elapsed / 60:.1f} min {line}", flush=True)
        if time.time() - last_save > 300:
            save()
            last_save = time.time()
    module.eval()
    save()
    return {"steps": step, "minutes": round((time.time() - t0) / 60, 1), "tokens": step * tokens_per_step,
            "batch": batch_size, "seq": seq, "peak_lr": peak_lr}


def combine(previous: dict | None, run: dict) -> dict:
    """Cumulative figures over a resumed model's runs; each run kept under "runs"."""
    if not previous:
        return {**run, "runs": [run]}
    runs = previous.get("runs", [previous]) + [run]
    total = {k: sum(r[k] for r in runs) for k in ("steps", "tokens")}
    total["minutes"] = round(sum(r["minutes"] for r in runs), 1)
    return {**run, **total, "peak_lr": "/".join(str(r["peak_lr"]) for r in runs), "runs": runs}
