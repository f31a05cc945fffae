"""A `Geometry` from a HuggingFace `config.json`, for the MoE families whose layer is router + routed
SwiGLU experts (+ shared expert): Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, Mixtral, OLMoE, Ling/BailingMoe.

Each family names the same numbers differently (the keys below are those of transformers' config
classes, and of the BailingMoe remote code). Dense layers before the MoE ones (`first_k_dense_replace`)
are not counted: a verify window's union only matters in MoE layers."""

from __future__ import annotations

from pathlib import Path

from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.json_file import read_json_object


class ConfigError(ValueError):
    """A config.json this module cannot read as a MoE geometry; the message names the key or family."""


def _get(config: dict, key: str, family: str):
    if key not in config or config[key] is None:
        raise ConfigError(f"{family} config.json: missing {key!r}")
    return config[key]


def _attention(config: dict, family: str) -> dict:
    heads = int(_get(config, "num_attention_heads", family))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or _get(config, "hidden_size", family) // heads)
    return dict(heads=heads, kv_heads=kv, head_dim=head_dim, vocab=_vocab(config))


def _vocab(config: dict) -> int:
    return int(config.get("vocab_size") or 0)


def _qwen_moe(config: dict, family: str, name: str) -> Geometry:
    sparse_step = int(config.get("decoder_sparse_step", 1) or 1)
    layers = int(_get(config, "num_hidden_layers", family))
    mlp_only = set(config.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in mlp_only and (i + 1) % sparse_step == 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return Geometry(name, int(_get(config, "hidden_size", family)), int(_get(config, "num_experts", family)),
                    int(_get(config, "num_experts_per_tok", family)),
                    int(_get(config, "moe_intermediate_size", family)), shared, moe_layers,
                    **_attention(config, family))


def _deepseek(config: dict, family: str, name: str) -> Geometry:
    inter = int(_get(config, "moe_intermediate_size", family))
    layers = int(_get(config, "num_hidden_layers", family)) - int(config.get("first_k_dense_replace") or 0)
    # MLA attention is not the GQA block this benchmark models: no attention part.
    return Geometry(name, int(_get(config, "hidden_size", family)), int(_get(config, "n_routed_experts", family)),
                    int(_get(config, "num_experts_per_tok", family)), inter,
                    int(config.get("n_shared_experts") or 0) * inter, layers, vocab=_vocab(config))


def _mixtral_like(config: dict, family: str, name: str) -> Geometry:
    experts_key = "num_local_experts" if family == "mixtral" else "num_experts"
    return Geometry(name, int(_get(config, "hidden_size", family)), int(_get(config, experts_key, family)),
                    int(_get(config, "num_experts_per_tok", family)), int(_get(config, "intermediate_size", family)),
                    0, int(_get(config, "num_hidden_layers", family)), **_attention(config, family))


def _bailing(config: dict, family: str, name: str) -> Geometry:
    inter = int(_get(config, "moe_intermediate_size", family))
    layers = int(_get(config, "num_hidden_layers", family)) - int(config.get("first_k_dense_replace") or 0)
    return Geometry(name, int(_get(config, "hidden_size", family)), int(_get(config, "num_experts", family)),
                    int(_get(config, "num_experts_per_tok", family)), inter,
                    int(config.get("num_shared_experts") or 0) * inter, layers, **_attention(config, family))


PARSERS = {"qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
           "mixtral": _mixtral_like, "olmoe": _mixtral_like, "bailing_moe": _bailing, "bailing_moe_v2": _bailing}


def geometry_from_config(config: dict, name: str | None = None) -> Geometry:
    family = config.get("model_type")
    if family not in PARSERS:
        raise ConfigError(f"config.json model_type {family!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[family](config, family, name or family)


def geometry_from_config_file(path: Path, name: str | None = None) -> Geometry:
    config = read_json_object(path, "config.json", ConfigError)
    return geometry_from_config(config, name or Path(path).parent.name or Path(path).stem)
