"""Render service/models/MODEL_CARD.md from the training report that train.py writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.engine.model.weights import DEFAULT_DRAFT_DIR, DEFAULT_HEAD_DIR, DEFAULT_TARGET_DIR, MODELS_DIR  # noqa: E402


def shape(cfg: dict) -> str:
    heads = f"{cfg['num_attention_heads']} ({cfg['num_key_value_heads']})"
    return f"{cfg['num_hidden_layers']} / {cfg['hidden_size']} / {heads}"


def render(report: dict) -> str:
    target_cfg = json.loads((DEFAULT_TARGET_DIR / "config.json").read_text())
    draft_cfg = json.loads((DEFAULT_DRAFT_DIR / "config.json").read_text())
    head_cfg = json.loads((DEFAULT_HEAD_DIR / "config.json").read_text())
    size = lambda d: (d / "model.safetensors").stat().st_size / 2**20  # noqa: E731
    t, d, h = report["target"], report["draft"], report["draft_head"]
    tc, dc, hc = target_cfg, draft_cfg, head_cfg
    rows = [
        ("architecture", "Qwen2-MoE (`qwen2_moe`)", "Qwen2 (`qwen2`, dense)",
         "draft head (`moespec_draft_head`): one decoder layer over the target's features"),
        ("layers / hidden / heads (kv)", shape(tc), shape(dc), shape(hc)),
        ("feed-forward",
         f"{tc['num_experts']} routed experts (top-{tc['num_experts_per_tok']}, intermediate "
         f"{tc['moe_intermediate_size']}) + 1 shared expert (intermediate {tc['shared_expert_intermediate_size']}) "
         "in every layer",
         f"SwiGLU, intermediate {dc['intermediate_size']}", f"SwiGLU, intermediate {hc['intermediate_size']}"),
        ("input", "tokens", "tokens",
         "the target's embedding of token p and its normed final hidden state at p - 1, projected 2H -> H"),
        ("vocabulary / context", f"{tc['vocab_size']} byte-level BPE / {tc['max_position_embeddings']}",
         f"same tokenizer / {dc['max_position_embeddings']}",
         f"drafts over the {hc['vocab_size']} most frequent training tokens (mapped to the target's ids) / "
         f"{hc['max_position_embeddings']}"),
        ("file size (bf16 safetensors)", f"{size(DEFAULT_TARGET_DIR):.1f} MiB", f"{size(DEFAULT_DRAFT_DIR):.1f} MiB",
         f"{size(DEFAULT_HEAD_DIR):.1f} MiB"),
        ("training",
         f"{t['steps']} steps x {t['batch']} x {t['seq']} tokens ({t['tokens'] / 1e6:.1f}M tokens), "
         f"{t['minutes']} min, "
         f"AdamW peak lr {t['peak_lr']}, cross-entropy + 0.01 x load-balancing loss",
         f"{d['steps']} steps ({d['tokens'] / 1e6:.1f}M tokens), {d['minutes']} min, distilled from the target "
         "(0.7 soft cross-entropy on its distribution + 0.3 cross-entropy)",
         f"{h['steps']} steps x {h['batch']} x {h['seq']} tokens ({h['tokens'] / 1e6:.1f}M tokens), {h['minutes']} "
         f"min on the frozen target: soft cross-entropy on the target's distribution + 0.1 x smooth-L1 to its "
         f"feature, over {h['unroll']} unrolled drafting steps (later steps read the head's own feature)"),
        ("held-out loss (nats/token)", str(report["target_heldout_loss"]), str(report["draft_heldout_loss"]),
         "(drafts over its own vocabulary; see the agreement below)"),
        ("used by", "both backends", "SGLang's STANDALONE speculative mode; `moespec serve --draft-model`",
         "the embedded engine's model drafter (default)"),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {e} |" for a, b, c, e in rows)
    reproduce = (f"python training/train.py --target-minutes {t['minutes']:g} --draft-minutes {d['minutes']:g} "
                 f"--head-minutes {h['minutes']:g} --threads {report['threads']}")
    uniform = f"E(1-(1-m/E)^5) with E={tc['num_experts']}, m={tc['num_experts_per_tok']}"
    return f"""# moespec shipped models

A small code-completion target and two drafts that share its tokenizer, trained on CPU by
`training/train.py`. Reproduce: `{reproduce}`

| | target (`target/`) | dense draft (`draft/`) | draft head (`draft-head/`) |
|---|---|---|---|
{table}

**Data.** {report['corpus']}: {report['train_files']} files for training ({report['train_tokens'] / 1e6:.2f}M
tokens), {report['heldout_files']} held out by a hash of the path ({report['heldout_tokens'] / 1e3:.0f}K tokens). The
shipped prompt set (`service/prompts/heldout.jsonl`) is cut from the held-out files only. The CPython sources are
under the PSF licence, which permits redistribution of derived works.

**Tokenizer.** Byte-level BPE trained with `tokenizers` using Qwen2's pre-tokenization (NFC, Qwen2's split regex,
byte-level), so `AutoTokenizer` (which builds `Qwen2Tokenizer`) and the engine's `tokenizers.Tokenizer` produce the
same ids; `<|endoftext|>` (id 0) separates files and ends generation.

**Quality** (24 windows of 256 tokens; greedy draft/target agreement per position, teacher-forced, same context):
{_quality(report)}
- mean distinct routed experts per layer over 5 consecutive positions (held-out):
  {report['unique_experts_5_window_per_layer']} vs {report['uniform_routing_5_window']} under uniform routing,
  {uniform}.

Total training wall time: {report['wall_minutes']} min for the target and dense draft, {h['minutes']} min for the head,
on {report['threads']} CPU thread(s) (a 2-core machine shared with other work).
{_eagle3(report)}"""


def _quality(report: dict) -> str:
    evaluation = report["draft_head"].get("evaluation", {})
    names = {"heldout_stdlib": "held-out standard-library code",
             "moespec_sources": "code unlike the training set (this repository's own sources)"}
    lines = []
    for key, name in names.items():
        e = evaluation.get(key)
        if e is None:
            continue
        chain = " / ".join(str(a) for a in e["head_greedy_agreement_by_chain_position"])
        covers = 100 * e["head_vocab_covers_target_greedy"]
        lines.append(f"- {name}, {e['tokens'] / 1e3:.0f}K tokens: draft head **{chain}** at chain positions 1 / 2 / 3 "
                     f"(its vocabulary holds the target's greedy token {covers:.1f}% of the time); dense draft "
                     f"{e['dense_draft_greedy_agreement']}")
    return "\n".join(lines) or f"- held-out: dense draft {report['greedy_agreement']}"


def _eagle3(report: dict) -> str:
    """The EAGLE-3 draft's section (training/eagle3.py), where the report has one."""
    e = report.get("eagle3")
    if not e or "steps" not in e:
        return ""
    head = report["draft_head"]["evaluation"]["heldout_stdlib"]
    chain = " / ".join(str(a) for a in e["greedy_agreement_by_chain_position"])
    head_chain = " / ".join(str(a) for a in head["head_greedy_agreement_by_chain_position"])
    size = (MODELS_DIR / "eagle3" / "model.safetensors").stat().st_size / 2**20
    text = f"""
## EAGLE-3 draft (`eagle3/`)

One decoder layer in SGLang's `LlamaForCausalLMEagle3` checkpoint format ({size:.1f} MiB; see
`docs/eagle3.md`): `fc` over the target's residual stream after layers {e['aux_layer_ids']}
(3 x 256 -> 256), attention over concat(embedding, hidden) (512 -> q/k/v), SwiGLU intermediate
{e['intermediate']}, the head's {e['draft_vocab']}-token draft vocabulary mapped by `d2t`, the target's
embedding. Trained by `python -m training.eagle3 --minutes {e['minutes']:g} --threads {e['threads']}`
on the frozen target, same corpus as the head: {e['steps']} steps x {e['batch']} x {e['seq']} tokens
({e['tokens'] / 1e6:.1f}M tokens), {e['minutes']} min, AdamW peak lr {e['peak_lr']}, soft
cross-entropy on the target's distribution over the draft vocabulary at {e['unroll']} unrolled drafting
steps (weights 1 / 0.8 / 0.64; later steps read the draft's own hidden state).

- held-out standard-library code (the head's 24 windows): EAGLE-3 **{chain}** at chain positions 1 / 2 / 3 vs the
  draft head's {head_chain} (teacher-forced greedy agreement)"""
    g = e.get("greedy_acceptance")
    if g:
        text += f"""
- greedy requests through the engine ({g['prompts']} held-out prompts, {g['max_new_tokens']} new tokens, draft length
  {g['draft_length']}, greedy drafts): drafted tokens accepted {g['eagle3']['accepted_share']} (EAGLE-3) vs
  {g['draft_head']['accepted_share']} (head); tokens per verify step {g['eagle3']['tokens_per_step']} vs
  {g['draft_head']['tokens_per_step']}"""
    return text + """
- the draft head stays the embedded engine's default model drafter (`--draft-model service/models/eagle3` serves this
  one).
"""


def main() -> None:
    report = json.loads((MODELS_DIR / "training_report.json").read_text())
    (MODELS_DIR / "MODEL_CARD.md").write_text(render(report))
    print(f"wrote {MODELS_DIR / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
