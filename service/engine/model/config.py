"""The shape of a Qwen2 / Qwen2-MoE decoder, read from and written to the hub's config.json.

Its own module because the weights' loader, the draft head and the benchmarks need a model's
sizes without the layers that use them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen2_moe" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen2_moe" and self.num_experts > 0

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        raw = json.loads(Path(path).read_text())
        rope = raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        fields = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs["rope_theta"] = float(theta)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """The config.json that transformers and SGLang read."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "bfloat16"
        d["use_sliding_window"] = False
        d["attention_dropout"] = 0.0
        if self.is_moe:
            d["architectures"] = ["Qwen2MoeForCausalLM"]
            d["decoder_sparse_step"] = 1
            d["mlp_only_layers"] = []
            d["qkv_bias"] = True
            d["output_router_logits"] = False
            d["router_aux_loss_coef"] = 0.001
        else:
            d["architectures"] = ["Qwen2ForCausalLM"]
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "norm_topk_prob"):
                d.pop(k)
        return d
