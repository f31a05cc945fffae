"""Render service/models/MODEL_CARD.md from the training report that train.py writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.engine.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, MODELS_DIR  # noqa: E402


def shape(cfg: dict) -> str:
    heads = f"{cfg['num_attention_heads']} ({cfg['num_key_value_heads']})"
    return f"{cfg['num_hidden_layers']} / {cfg['hidden_size']} / {heads}"


def render(report: dict) -> str:
    target_cfg = json.loads((DEFAULT_TARGET_DIR / "config.json").read_text())
    draft_cfg = json.loads((DEFAULT_DRAFT_DIR / "config.json").read_text())
    size = lambda d: (d / "model.safetensors").stat().st_size / 2**20  # noqa: E731
    t, d = report["target"], report["draft"]
    tc, dc = target_cfg, draft_cfg
    rows = [
        ("architecture", "Qwen2-MoE (`qwen2_moe`)", "Qwen2 (`qwen2`, dense)"),
        ("layers / hidden / heads (kv)", shape(tc), shape(dc)),
        ("feed-forward",
         f"{tc['num_experts']} routed experts (top-{tc['num_experts_per_tok']}, intermediate "
         f"{tc['moe_intermediate_size']}) + 1 shared expert (intermediate {tc['shared_expert_intermediate_size']}) "
         "in every layer",
         f"SwiGLU, intermediate {dc['intermediate_size']}"),
        ("vocabulary / context", f"{tc['vocab_size']} byte-level BPE / {tc['max_position_embeddings']}",
         f"same tokenizer / {dc['max_position_embeddings']}"),
        ("file size (bf16 safetensors)", f"{size(DEFAULT_TARGET_DIR):.1f} MiB", f"{size(DEFAULT_DRAFT_DIR):.1f} MiB"),
        ("training",
         f"{t['steps']} steps x {t['batch']} x {t['seq']} tokens ({t['tokens'] / 1e6:.1f}M tokens), "
         f"{t['minutes']} min, "
         f"AdamW peak lr {t['peak_lr']}, cross-entropy + 0.01 x load-balancing loss",
         f"{d['steps']} steps ({d['tokens'] / 1e6:.1f}M tokens), {d['minutes']} min, distilled from the target "
         "(0.7 soft cross-entropy on its distribution + 0.3 cross-entropy)"),
        ("held-out loss (nats/token)", str(report["target_heldout_loss"]), str(report["draft_heldout_loss"])),
    ]
    table = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    reproduce = (f"python training/train.py --target-minutes {t['minutes']:g} --draft-minutes {d['minutes']:g} "
                 f"--threads {report['threads']}")
    uniform = f"E(1-(1-m/E)^5) with E={tc['num_experts']}, m={tc['num_experts_per_tok']}"
    return f"""# moespec shipped model pair

Two small code-completion models that share one tokenizer, trained on CPU by `training/train.py`.
Reproduce: `{reproduce}`

| | target (`target/`) | draft (`draft/`) |
|---|---|---|
{table}

**Data.** {report['corpus']}: {report['train_files']} files for training ({report['train_tokens'] / 1e6:.2f}M
tokens), {report['heldout_files']} held out by a hash of the path ({report['heldout_tokens'] / 1e3:.0f}K tokens). The
shipped prompt set (`service/prompts/heldout.jsonl`) is cut from the held-out files only. The CPython sources are
under the PSF licence, which permits redistribution of derived works.

**Tokenizer.** Byte-level BPE trained with `tokenizers` using Qwen2's pre-tokenization (NFC, Qwen2's split regex,
byte-level), so `AutoTokenizer` (which builds `Qwen2Tokenizer`) and the engine's `tokenizers.Tokenizer` produce the
same ids; `<|endoftext|>` (id 0) separates files and ends generation.

**Quality on held-out code** ({report.get('eval_windows', 24)} windows of 256 tokens):
- greedy draft/target agreement per position (teacher-forced, same context): **{report['greedy_agreement']}**
- mean distinct routed experts per layer over 5 consecutive positions: {report['unique_experts_5_window_per_layer']}
  vs {report['uniform_routing_5_window']} under uniform routing, {uniform}.

Total training wall time: {report['wall_minutes']} min on {report['threads']} CPU thread(s) (a 2-core machine shared
with other work).
"""


def main() -> None:
    report = json.loads((MODELS_DIR / "training_report.json").read_text())
    (MODELS_DIR / "MODEL_CARD.md").write_text(render(report))
    print(f"wrote {MODELS_DIR / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
