"""Train the EAGLE-3 draft (service/engine/model/eagle3.py) on the frozen shipped target.

Each batch runs the target once (no gradient) for the residual streams of its aux layers and its
distribution at every position; the draft learns, at each of UNROLL unrolled drafting steps
(EAGLE-3's training-time test: later steps read the draft's own output hidden), the target's
distribution over the draft vocabulary (soft cross-entropy). Same corpus, draft vocabulary and
held-out windows as the draft head (training/head.py), so the two compare directly.

    python -m training.eagle3 --minutes 40 --threads 1

Writes service/models/eagle3/ (SGLang's LlamaForCausalLMEagle3 checkpoint: config.json +
model.safetensors, also every 5 minutes during the run) and the "eagle3" part of
service/models/training_report.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from service.engine.model.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3, save_eagle3
from service.engine.model.training import features_and_aux_train
from service.engine.model.transformer import Transformer
from service.engine.model.weights import DEFAULT_TARGET_DIR, MODELS_DIR, load_model
from training.common import batch, combine, corpus_files, encode, train_for
from training.head import DRAFT_VOCAB, draft_vocabulary

DEFAULT_EAGLE3_DIR = MODELS_DIR / "eagle3"
INTERMEDIATE = 512
UNROLL = 3  # drafting steps trained per entry: a chain's first token and two that read the draft's own hidden
STEP_WEIGHTS = (1.0, 0.8, 0.64)  # EAGLE-3's 0.8 ** step decay


def new_draft(target: Transformer, train_ids: torch.Tensor) -> Eagle3Draft:
    """A fresh draft for `target`: the head's draft vocabulary (the corpus's most frequent tokens),
    its output layer started from the target's rows for those tokens."""
    vocab = draft_vocabulary(train_ids, DRAFT_VOCAB, target.cfg.eos_token_id)
    draft = Eagle3Draft(Eagle3Config.for_target(target.cfg, DRAFT_VOCAB, INTERMEDIATE))
    draft.set_vocabulary(vocab)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab])
    return draft


def target_view(target: Transformer, tokens: torch.Tensor, aux_layer_ids: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T+1] -> (embeddings of tokens 1..T [B, T, H], aux at 0..T-1 [B, T, 3H], the
    target's full-vocabulary logits at 1..T [B, T, V]: entry p's label)."""
    with torch.no_grad():
        features, _, aux = features_and_aux_train(target, tokens, aux_layer_ids)
        return target.embed_tokens(tokens[:, 1:]), aux[:, :-1], target.lm_head(features[:, 1:])


def draft_loss(draft: Eagle3Draft, embedded: torch.Tensor, aux: torch.Tensor, logits: torch.Tensor,
               steps: int = UNROLL) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over unrolled steps; also each step's greedy agreement with the target."""
    vocab = draft.target_ids
    soft = logits[..., vocab].softmax(-1)  # the target's distribution renormalised over the draft vocabulary
    target_top = logits.argmax(-1)  # [B, T] over the full vocabulary
    total, agreement = 0.0, []
    for s, (draft_logits, _) in enumerate(draft.forward_train(embedded, aux, steps)):
        valid = slice(s, None)  # entry p has a chain root only from p = s on
        ce = -(soft[:, valid] * draft_logits[:, valid].log_softmax(-1)).sum(-1).mean()
        total = total + STEP_WEIGHTS[s] * ce
        agreement.append((vocab[draft_logits[:, valid].argmax(-1)] == target_top[:, valid]).float().mean().item())
    return total, agreement


def train_draft(target: Transformer, draft: Eagle3Draft, data: torch.Tensor, minutes: float, peak_lr: float,
                out_dir: Path, batch_size: int, seq: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = draft.cfg.aux_layer_ids

    def loss_of_batch() -> tuple[torch.Tensor, str]:
        loss, agreement = draft_loss(draft, *target_view(target, batch(data, batch_size, seq, gen), ids))
        return loss, f"loss {loss.item():.3f} agreement {' '.join(f'{a:.3f}' for a in agreement)}"

    return train_for(draft, minutes, peak_lr, 0.01, loss_of_batch, lambda: save_eagle3(draft, out_dir), "eagle3", 20,
                     batch_size * seq, batch_size, seq)


@torch.no_grad()
def evaluate_draft(target: Transformer, draft: Eagle3Draft, data: torch.Tensor, windows: int = 24) -> dict:
    """Teacher-forced greedy agreement per chain position on the head's held-out windows (same seed
    and size as training/head.py's evaluate_head), and the draft vocabulary's coverage."""
    gen = torch.Generator().manual_seed(1234)
    tokens = batch(data, windows, 256, gen)  # [24, 257]: entries 0..255 as the head's
    embedded, aux, logits = target_view(target, tokens, draft.cfg.aux_layer_ids)
    _, agreement = draft_loss(draft, embedded, aux, logits)
    in_vocab = torch.isin(logits.argmax(-1), draft.target_ids).float().mean().item()
    return {"greedy_agreement_by_chain_position": [round(a, 3) for a in agreement],
            "vocab_covers_target_greedy": round(in_vocab, 3)}


def greedy_acceptance(draft_dir: Path, prompts: list[str], draft_length: int, max_new_tokens: int) -> dict:
    """Greedy requests (greedy drafts) on `prompts` through the embedded engine with `draft_dir`:
    the share of drafted tokens accepted and the tokens committed per verify step."""
    from service.engine import Engine, EngineConfig
    from service.types import DraftPolicy, GenerationRequest, SamplingParams

    engine = Engine(EngineConfig(draft_dir=draft_dir, threads=1, math="fp32"))
    drafted = accepted = steps = committed = 0
    try:
        for prompt in prompts:
            result = engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens,
                                                       sampling=SamplingParams(temperature=0)),
                                     DraftPolicy(draft_length=draft_length, draft_temperature=0))
            drafted += sum(s.drafted for s in result.steps)
            accepted += sum(s.accepted for s in result.steps)
            steps += len(result.steps)
            committed += sum(s.committed for s in result.steps)
    finally:
        engine.close()
    return {"accepted_share": round(accepted / max(drafted, 1), 3), "tokens_per_step": round(committed / steps, 3)}


def compare_acceptance(eagle3_dir: Path, prompts: int, draft_length: int, max_new_tokens: int) -> dict:
    """The EAGLE-3 draft against the shipped draft head on the shipped held-out prompts."""
    from service.engine.model.weights import DEFAULT_HEAD_DIR

    lines = (MODELS_DIR.parent / "prompts" / "heldout.jsonl").read_text().splitlines()[:prompts]
    texts = [json.loads(line)["prompt"] for line in lines]
    return {"prompts": len(texts), "draft_length": draft_length, "max_new_tokens": max_new_tokens,
            "eagle3": greedy_acceptance(eagle3_dir, texts, draft_length, max_new_tokens),
            "draft_head": greedy_acceptance(DEFAULT_HEAD_DIR, texts, draft_length, max_new_tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", type=Path, default=DEFAULT_EAGLE3_DIR)
    ap.add_argument("--resume", action="store_true", help="continue training the draft in --out (new batches)")
    ap.add_argument("--evaluate", action="store_true", help="only evaluate the draft in --out (printed)")
    ap.add_argument("--compare", action="store_true",
                    help="only measure greedy acceptance of the draft in --out and of the draft head on the "
                         "held-out prompts, into the report")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tokenizers import Tokenizer

    report_path = MODELS_DIR / "training_report.json"
    if args.compare:
        report = json.loads(report_path.read_text())
        report.setdefault("eagle3", {})["greedy_acceptance"] = compare_acceptance(args.out, 16, 3, 48)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["eagle3"]["greedy_acceptance"], indent=2))
        return
    tok = Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))
    train_files, heldout_files = corpus_files()
    train_ids, heldout_ids = encode(tok, train_files), encode(tok, heldout_files)
    target = load_model(DEFAULT_TARGET_DIR)
    if args.evaluate:
        metrics = evaluate_draft(target, load_eagle3(args.out), heldout_ids)
        print(json.dumps(metrics, indent=2))
        return
    previous = json.loads(report_path.read_text()).get("eagle3") if args.resume and report_path.is_file() else None
    draft = load_eagle3(args.out).requires_grad_(True) if args.resume else new_draft(target, train_ids)
    seed = len((previous or {}).get("runs", [previous] if previous else []))  # a resumed run draws new batches
    run = train_draft(target, draft, train_ids, args.minutes, args.lr, args.out, args.batch, args.seq, seed=seed)
    metrics = evaluate_draft(target, draft, heldout_ids)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}  # re-read: others may have written
    report["eagle3"] = {**combine(previous, run), "draft_vocab": draft.cfg.draft_vocab_size,
                        "intermediate": draft.cfg.intermediate_size, "unroll": UNROLL,
                        "aux_layer_ids": list(draft.cfg.aux_layer_ids), "threads": args.threads, **metrics}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["eagle3"], indent=2))


if __name__ == "__main__":
    main()
