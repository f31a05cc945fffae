"""MoE geometry of a Hugging Face model directory, read from its config.json without SGLang.

The recorder's topk_ids_of_layer has one row per decoder layer (Qwen2-MoE's
`get_model_config_for_expert_location` uses num_hidden_layers), dense layers included; moespec
reports only the MoE layers, so this module says which layers those are for the families SGLang
serves that moespec names: Qwen2/Qwen3-MoE, DeepSeek-V2/V3 (and Kimi-K2), Ling/BailingMoe(V2), Mixtral.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class ModelDirError(ValueError):
    """A model path that cannot be served; the message says what is wrong."""


@dataclass(frozen=True)
class MoeGeometry:
    name: str
    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # decoder layer indices whose MLP is routed
    num_experts: int
    top_k: int
    shared_experts: int
    vocab_size: int
    max_context: int
    expert_bytes: int  # one routed expert's gate, up and down projections
    hidden_size: int = 0  # width of a token's hidden state (what EP dispatch moves per pair)


def read_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: no such directory (give a local model directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelDirError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable ({e})") from None
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise ModelDirError(f"{model_dir}: no *.safetensors or *.bin weights")
    return config


def moe_geometry(model_dir: Path) -> MoeGeometry:
    cfg = read_config(model_dir)
    n_layers = int(cfg.get("num_hidden_layers", 0))
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not experts or not top_k or not n_layers:
        raise ModelDirError(f"{model_dir}: config.json describes no routed experts (the target must be an MoE model)")
    layers = _moe_layers(cfg, n_layers)
    intermediate = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    hidden = int(cfg.get("hidden_size", 0))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return MoeGeometry(
        name=Path(model_dir).resolve().name,
        model_type=str(cfg.get("model_type", "")),
        num_hidden_layers=n_layers,
        moe_layers=layers,
        num_experts=experts,
        top_k=top_k,
        shared_experts=_shared_experts(cfg),
        vocab_size=int(cfg.get("vocab_size", 0)),
        max_context=int(cfg.get("max_position_embeddings", 0)),
        expert_bytes=3 * hidden * intermediate * _DTYPE_BYTES.get(dtype, 2),
        hidden_size=hidden,
    )


def _moe_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    if "first_k_dense_replace" in cfg:  # DeepSeek-V2/V3, Kimi-K2, BailingMoe
        first, freq = int(cfg["first_k_dense_replace"]), int(cfg.get("moe_layer_freq", 1) or 1)
        return tuple(i for i in range(n_layers) if i >= first and i % freq == 0)
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen2-MoE, Qwen3-MoE
        step, dense = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or ())
        return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    return tuple(range(n_layers))  # Mixtral and others: every layer routed


def _shared_experts(cfg: dict) -> int:
    for key in ("n_shared_experts", "num_shared_experts"):
        if cfg.get(key):
            return int(cfg[key])
    # Qwen2-MoE has one shared expert (with its own sigmoid gate) when its width is set.
    return 1 if cfg.get("shared_expert_intermediate_size") else 0


def dense_name(model_dir: Path) -> str:
    """Name of a draft directory after checking it is loadable (config.json and weights)."""
    read_config(model_dir)
    return Path(model_dir).resolve().name
