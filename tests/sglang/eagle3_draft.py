"""A small random-init draft in SGLang's EAGLE-3 checkpoint format, for tests that need an EAGLE-3
draft for the shipped target whatever its quality (greedy speculation is lossless by construction).

The format is what SGLang 0.5.23's `LlamaForCausalLMEagle3.load_weights` (models/llama_eagle3.py)
reads: `fc` over the target's concatenated aux hidden states, one decoder layer under `midlayer.`
(q/k/v/o, gate/up/down, input/post-attention/hidden norms), a final `norm`, an `lm_head` over a
reduced draft vocabulary and `d2t` (draft id -> target id offset; `t2d` is skipped by the loader).
The input embedding is the target's (the draft worker binds it through `get_embed_and_head`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

AUX_LAYERS = (0, 1, 2)  # target layers whose outputs the draft reads (the target has 4)


def write_eagle3_draft(out: Path, target_dir: Path, *, draft_vocab: int = 1024, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and the target's tokenizer files into `out`."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, inter = hidden // heads, 2 * hidden
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
        "max_position_embeddings": target["max_position_embeddings"], "rope_theta": target["rope_theta"],
        "rms_norm_eps": target["rms_norm_eps"], "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": target["eos_token_id"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "use_aux_hidden_state": True},
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # target ids the draft can propose
    tensors = {
        "fc.weight": w(hidden, hidden * len(AUX_LAYERS)),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, out / name)
    return out
