"""Reproduce the shipped models: tokenizer, Qwen2-MoE target, distilled dense Qwen2 draft, the draft
head on the frozen target (training/head.py), model card.

Corpus: the non-test Python sources of the CPython standard library that runs this script (present
wherever Python runs, PSF licence). Files are split into train / held-out by a hash of their path,
so the held-out set (and the shipped prompt set cut from it) never appears in training.

    python training/train.py --target-minutes 28 --draft-minutes 12 --head-minutes 60

Writes service/models/{target,draft,draft-head}/ and service/models/MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.engine.model.config import ModelConfig  # noqa: E402
from service.engine.model.draft_head import load_head  # noqa: E402
from service.engine.model.training import forward_train, init_weights  # noqa: E402
from service.engine.model.transformer import Transformer  # noqa: E402
from service.engine.model.weights import (  # noqa: E402
    DEFAULT_DRAFT_DIR,
    DEFAULT_HEAD_DIR,  # noqa: E402
    DEFAULT_TARGET_DIR,
    MODELS_DIR,
    load_model,
    save_model,
)
from training.common import EOS, batch, combine, corpus_files, encode, read, train_for  # noqa: E402
from training.head import evaluate_head, evaluate_shipped, head_report, new_head, train_head  # noqa: E402
from training.model_card import render as render_model_card  # noqa: E402

VOCAB = 4096
CONTEXT = 512


# Qwen2's pre-tokenization (transformers' Qwen2Tokenizer rebuilds exactly this pipeline around the
# vocabulary, whatever tokenizer.json says), so every loader splits text the same way.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(files: list[Path]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read(p) for p in files), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": EOS, "pad_token": EOS,
              "bos_token": None, "unk_token": None, "model_max_length": CONTEXT, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def target_config(eos: int) -> ModelConfig:
    return ModelConfig(model_type="qwen2_moe", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                       max_position_embeddings=CONTEXT, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, num_experts=64, num_experts_per_tok=8,
                       moe_intermediate_size=64, shared_expert_intermediate_size=256,
                       norm_topk_prob=False, eos_token_id=eos)


def draft_config(eos: int) -> ModelConfig:
    return ModelConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=768,
                       max_position_embeddings=CONTEXT, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=eos)


def train(model: Transformer, data: torch.Tensor, minutes: float, peak_lr: float, out_dir: Path,
          teacher: Transformer | None = None, batch_size: int = 8, seq: int = CONTEXT, seed: int = 0) -> dict:
    """Train for a wall-clock budget; with a teacher, distil its distribution (soft cross-entropy)."""
    gen = torch.Generator().manual_seed(seed)

    def loss_of_batch() -> tuple[torch.Tensor, str]:
        xy = batch(data, batch_size, seq, gen)
        x, y = xy[:, :-1], xy[:, 1:]
        logits, balance = forward_train(model, x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce + 0.01 * balance
        if teacher is not None:
            with torch.no_grad():
                soft = forward_train(teacher, x)[0].softmax(-1)
            loss = 0.3 * ce + 0.7 * -(soft * logits.log_softmax(-1)).sum(-1).mean()
        return loss, f"ce {ce.item():.3f} balance {balance.item():.3f}"

    return train_for(model, minutes, peak_lr, 0.1, loss_of_batch, lambda: save_model(model, out_dir), out_dir.name,
                     50, batch_size * seq, batch_size, seq)


@torch.no_grad()
def evaluate(target: Transformer, draft: Transformer, data: torch.Tensor, windows: int = 24) -> dict:
    """Held-out loss of both, teacher-forced greedy agreement, and 5-position expert unions per layer."""
    gen = torch.Generator().manual_seed(1234)
    xy = batch(data, windows, 256, gen)
    x, y = xy[:, :-1], xy[:, 1:]
    t_logits, _ = forward_train(target, x)
    d_logits, _ = forward_train(draft, x)
    loss = lambda lg: F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1)).item()  # noqa: E731
    agreement = (t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()
    # Routed ids per layer from a pass over the flattened windows: [L, B*T, m].
    cfg = target.cfg
    unions = []
    h = target.embed_tokens(x)
    cos, sin = target.rope_cos[:x.shape[1]], target.rope_sin[:x.shape[1]]
    for layer in target.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
        flat = layer.post_attention_layernorm(h).reshape(-1, cfg.hidden_size)
        out, _, ids = layer.mlp(flat)
        h = h + out.view_as(h)
        per_pos = F.one_hot(ids.view(x.shape[0], x.shape[1], -1), cfg.num_experts).sum(2).clamp(max=1)  # [B, T, E]
        win = per_pos.unfold(1, 5, 5).amax(-1)  # [B, T/5, E] union over 5 consecutive positions
        unions.append(win.sum(-1).float().mean().item())
    E, m = cfg.num_experts, cfg.num_experts_per_tok
    return {"target_heldout_loss": round(loss(t_logits), 3), "draft_heldout_loss": round(loss(d_logits), 3),
            "greedy_agreement": round(agreement, 3), "unique_experts_5_window_per_layer": [round(u, 1) for u in unions],
            "uniform_routing_5_window": round(E * (1 - (1 - m / E) ** 5), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-minutes", type=float, default=28)
    ap.add_argument("--draft-minutes", type=float, default=12)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--head-minutes", type=float, default=60,
                    help="the draft head's training (0: keep the shipped one)")
    ap.add_argument("--head-lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true",
                    help="continue training the shipped checkpoints (same tokenizer) with a fresh schedule")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    train_files, heldout_files = corpus_files()
    previous = None
    if args.resume:
        tok = Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))
        previous = json.loads((MODELS_DIR / "training_report.json").read_text())
    else:
        tok = train_tokenizer(train_files)
        for d in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR):
            save_tokenizer(tok, d)
    train_ids, heldout_ids = encode(tok, train_files), encode(tok, heldout_files)
    print(f"tokenizer done in {time.time() - t0:.0f}s: {train_ids.numel()} train / "
          f"{heldout_ids.numel()} held-out tokens", flush=True)
    eos = tok.token_to_id(EOS)
    if args.resume:
        target, draft = (load_model(d).requires_grad_(True) for d in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR))
    else:
        target, draft = Transformer(target_config(eos)), Transformer(draft_config(eos))
        init_weights(target)
        init_weights(draft)
        save_model(target, DEFAULT_TARGET_DIR)
        save_model(draft, DEFAULT_DRAFT_DIR)
    seed = 10 * len((previous or {}).get("target", {}).get("runs", [None] if previous else []))  # new batches
    target_run = train(target, train_ids, args.target_minutes, args.target_lr, DEFAULT_TARGET_DIR, seed=seed)
    draft_run = train(draft, train_ids, args.draft_minutes, args.draft_lr, DEFAULT_DRAFT_DIR, teacher=target,
                      seed=seed + 1)
    metrics = evaluate(target, draft, heldout_ids)
    if args.head_minutes > 0:  # on the final target, frozen
        head = load_head(DEFAULT_HEAD_DIR, for_inference=False).requires_grad_(True) if args.resume \
            else new_head(target, train_ids)
        head.vocab.requires_grad_(False)
        target.requires_grad_(False)
        head_run = train_head(target, head, train_ids, args.head_minutes, args.head_lr, DEFAULT_HEAD_DIR, 16, 256,
                              seed=seed + 2)
        previous_head = (previous or {}).get("draft_head")
        metrics["draft_head"] = head_report(head, combine(previous_head, head_run),
                                            evaluate_head(target, head, heldout_ids), args.threads)
        metrics["draft_head"]["evaluation"] = evaluate_shipped(tok, heldout_ids)  # both drafts, as shipped
    elif previous and "draft_head" in previous:
        metrics["draft_head"] = previous["draft_head"]
    card = {"corpus": f"CPython {sys.version.split()[0]} standard library, non-test .py files",
            "train_files": len(train_files), "heldout_files": len(heldout_files),
            "train_tokens": train_ids.numel(), "heldout_tokens": heldout_ids.numel(),
            "target": combine(previous and previous["target"], target_run),
            "draft": combine(previous and previous["draft"], draft_run), "threads": args.threads,
            "wall_minutes": round((time.time() - t0) / 60 + (previous or {}).get("wall_minutes", 0), 1), **metrics}
    (MODELS_DIR / "training_report.json").write_text(json.dumps(card, indent=2) + "\n")
    (MODELS_DIR / "MODEL_CARD.md").write_text(render_model_card(card))
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
