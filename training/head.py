"""Train the draft head (service/engine/model/draft_head.py) on the frozen shipped target.

Each batch runs the target once (no gradient) for its normed final hidden states and its
distribution at every position; the head learns, for every unrolled drafting step, the target's
distribution over the draft vocabulary (soft cross-entropy) and, lightly, the target's feature
(smooth L1), since its own feature is what the next drafting step reads.

    python -m training.head --minutes 60 --threads 1

Writes service/models/draft-head/ and its part of service/models/training_report.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from service.engine.model.draft_head import DraftHead, head_config, load_head, save_head
from service.engine.model.training import features_train, forward_train
from service.engine.model.transformer import Transformer
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_HEAD_DIR, DEFAULT_TARGET_DIR, MODELS_DIR, load_model
from training.common import batch, combine, corpus_files, encode, train_for

DRAFT_VOCAB = 1024
INTERMEDIATE = 512
UNROLL = 3  # drafting steps trained per entry: a chain's first token and two that read the head's own feature
STEP_WEIGHTS = (1.0, 0.8, 0.6)
FEATURE_WEIGHT = 0.1


def draft_vocabulary(train_ids: torch.Tensor, size: int, eos: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training corpus (EOS always in), ascending."""
    counts = torch.bincount(train_ids, minlength=int(train_ids.max()) + 1)
    counts[eos] = counts.max() + 1
    return counts.topk(size).indices.sort().values


def new_head(target: Transformer, train_ids: torch.Tensor) -> DraftHead:
    """A fresh head for `target`: the draft vocabulary from the corpus, its output layer started from
    the target's rows for those tokens."""
    vocab = draft_vocabulary(train_ids, DRAFT_VOCAB, target.cfg.eos_token_id)
    head = DraftHead(head_config(target.cfg, DRAFT_VOCAB, INTERMEDIATE), target.cfg.vocab_size)
    head.vocab.copy_(vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab])
    return head


def head_report(head: DraftHead, run: dict, metrics: dict, threads: int) -> dict:
    return {**run, "draft_vocab": head.cfg.vocab_size, "intermediate": head.cfg.intermediate_size, "unroll": UNROLL,
            "threads": threads, **metrics}


def target_view(target: Transformer, tokens: torch.Tensor, vocab: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (embeddings [B, T, H], normed final features [B, T, H], full-vocab logits [B, T, V])."""
    with torch.no_grad():
        features, _ = features_train(target, tokens)
        return target.embed_tokens(tokens), features, target.lm_head(features)


def head_loss(head: DraftHead, embedded: torch.Tensor, features: torch.Tensor, logits: torch.Tensor
              ) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over unrolled steps; also each step's greedy agreement with the target."""
    soft = logits[..., head.vocab].softmax(-1)  # the target's distribution renormalised over the draft vocabulary
    target_top = logits.argmax(-1)  # [B, T] over the full vocabulary
    total, agreement = 0.0, []
    for s, (draft_logits, fhat) in enumerate(head.forward_train(embedded, features, UNROLL)):
        valid = slice(s, None)  # entry p has a chain root only from p = s on
        ce = -(soft[:, valid] * draft_logits[:, valid].log_softmax(-1)).sum(-1).mean()
        reg = F.smooth_l1_loss(fhat[:, valid], features[:, valid])
        total = total + STEP_WEIGHTS[s] * (ce + FEATURE_WEIGHT * reg)
        agreement.append((head.vocab[draft_logits[:, valid].argmax(-1)] == target_top[:, valid]).float().mean().item())
    return total, agreement


def train_head(target: Transformer, head: DraftHead, data: torch.Tensor, minutes: float, peak_lr: float,
               out_dir: Path, batch_size: int, seq: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def loss_of_batch() -> tuple[torch.Tensor, str]:
        tokens = batch(data, batch_size, seq, gen)[:, :-1]
        loss, agreement = head_loss(head, *target_view(target, tokens, head.vocab))
        return loss, f"loss {loss.item():.3f} agreement {' '.join(f'{a:.3f}' for a in agreement)}"

    return train_for(head, minutes, peak_lr, 0.01, loss_of_batch, lambda: save_head(head, out_dir), "head", 20,
                     batch_size * seq, batch_size, seq)


@torch.no_grad()
def evaluate_head(target: Transformer, head: DraftHead, data: torch.Tensor, windows: int = 24) -> dict:
    """Teacher-forced greedy agreement per chain position on held-out windows, and the draft
    vocabulary's coverage of the target's own greedy choices there."""
    gen = torch.Generator().manual_seed(1234)
    tokens = batch(data, windows, 256, gen)[:, :-1]
    embedded, features, logits = target_view(target, tokens, head.vocab)
    _, agreement = head_loss(head, embedded, features, logits)
    in_vocab = torch.isin(logits.argmax(-1), head.vocab).float().mean().item()
    return {"head_greedy_agreement_by_chain_position": [round(a, 3) for a in agreement],
            "head_vocab_covers_target_greedy": round(in_vocab, 3)}


@torch.no_grad()
def dense_agreement(target: Transformer, draft: Transformer, data: torch.Tensor, windows: int = 24) -> float:
    """The dense draft's teacher-forced greedy agreement on the same windows as `evaluate_head`."""
    tokens = batch(data, windows, 256, torch.Generator().manual_seed(1234))[:, :-1]
    return round((forward_train(target, tokens)[0].argmax(-1) == forward_train(draft, tokens)[0].argmax(-1))
                 .float().mean().item(), 3)


def unlike_corpus_files() -> list[Path]:
    """Code unlike the training set: this repository's own Python sources (never trained on)."""
    root = Path(__file__).resolve().parents[1]
    return sorted(p for d in ("service", "tuner", "otel", "tests", "training") for p in (root / d).rglob("*.py")
                  if "proto_gen" not in p.parts)


def evaluate_shipped(tok, heldout_ids: torch.Tensor) -> dict:
    """Both drafters on held-out standard-library code and on code unlike it."""
    target, head = load_model(DEFAULT_TARGET_DIR), load_head(DEFAULT_HEAD_DIR, for_inference=False)
    dense = load_model(DEFAULT_DRAFT_DIR)
    unlike = unlike_corpus_files()
    corpora = {"heldout_stdlib": heldout_ids, "moespec_sources": encode(tok, unlike)}
    out = {}
    for name, ids in corpora.items():
        out[name] = {**evaluate_head(target, head, ids), "tokens": ids.numel(),
                     "dense_draft_greedy_agreement": dense_agreement(target, dense, ids)}
    out["moespec_sources"]["files"] = len(unlike)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", type=Path, default=DEFAULT_HEAD_DIR)
    ap.add_argument("--resume", action="store_true",
                    help="continue training the head in --out with a fresh schedule (new batches)")
    ap.add_argument("--evaluate", action="store_true",
                    help="only evaluate the shipped head and dense draft (held-out and unlike code) into the report")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))
    train_files, heldout_files = corpus_files()
    report_path = MODELS_DIR / "training_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    if args.evaluate:
        report.setdefault("draft_head", {})["evaluation"] = evaluate_shipped(tok, encode(tok, heldout_files))
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["draft_head"]["evaluation"], indent=2))
        return
    train_ids, heldout_ids = encode(tok, train_files), encode(tok, heldout_files)
    target = load_model(DEFAULT_TARGET_DIR)
    previous = report.get("draft_head") if args.resume else None
    if args.resume:
        head = load_head(args.out, for_inference=False).requires_grad_(True)
        head.vocab.requires_grad_(False)
    else:
        head = new_head(target, train_ids)
    seed = len((previous or {}).get("runs", [previous] if previous else []))  # a resumed run draws new batches
    run = train_head(target, head, train_ids, args.minutes, args.lr, args.out, args.batch, args.seq, seed=seed)
    metrics = evaluate_head(target, head, heldout_ids)
    report["draft_head"] = head_report(head, combine(previous, run), metrics, args.threads)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["draft_head"], indent=2))


if __name__ == "__main__":
    main()
