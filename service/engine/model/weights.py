"""Load and save a model directory in the hub layout that transformers and SGLang read.

A directory holds `config.json`, `model.safetensors` (bf16) and the tokenizer files. On disk each
routed expert has its own `mlp.experts.{j}.{gate,up,down}_proj.weight`; in memory the experts of a
layer are stacked (`layers.Experts`), as in transformers >= 5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from service.engine.kernels.library import Kernels
from service.engine.kernels.pool import ONE_THREAD, KernelThreads
from service.engine.model.config import ModelConfig
from service.engine.model.layers import KERNEL_WINDOW_MAX
from service.engine.model.transformer import Transformer

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
DEFAULT_TARGET_DIR = MODELS_DIR / "target"
DEFAULT_DRAFT_DIR = MODELS_DIR / "draft"
DEFAULT_HEAD_DIR = MODELS_DIR / "draft-head"

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hub_state(model: Transformer) -> dict[str, torch.Tensor]:
    """In-memory names -> hub names (model. prefix, one tensor per expert projection).

    lm_head.weight is written even when tied: SGLang's Qwen2-MoE never ties it and would
    otherwise serve an uninitialised output layer.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        hub = name if name.startswith("lm_head") else f"model.{name}"
        if name.endswith("experts.gate_up_proj"):
            prefix = hub.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)  # [E, I, H] each
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            prefix = hub.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[hub] = tensor
    return out


def from_hub_state(hub: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hub names -> in-memory names, stacking the per-expert projections of each layer."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in hub.items():
        match = _EXPERT_KEY.match(name)
        if match:
            prefix, e, proj = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = tensor
        else:
            state[name.removeprefix("model.")] = tensor
    for prefix, projs in experts.items():
        local = prefix.removeprefix("model.")
        stack = {p: torch.stack([projs[p][e] for e in range(cfg.num_experts)]) for p in projs}
        state[f"{local}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        state[f"{local}.down_proj"] = stack["down_proj"]
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    return state


def save_model(model: Transformer, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # clone: tied tensors must not share memory in a safetensors file
    tensors = {k: v.detach().to(dtype).clone() for k, v in to_hub_state(model).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2) + "\n")


def load_model(directory: Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """Build a model from a directory; raises FileNotFoundError / ValueError naming what is wrong."""
    directory = Path(directory)
    for required in ("config.json", "model.safetensors"):
        if not (directory / required).is_file():
            raise FileNotFoundError(f"model directory {directory} has no {required}")
    cfg = ModelConfig.from_json(directory / "config.json")
    if cfg.model_type not in ("qwen2", "qwen2_moe"):
        raise ValueError(f"{directory}: model_type {cfg.model_type!r} is not qwen2 or qwen2_moe")
    model = Transformer(cfg)
    state = from_hub_state(load_file(str(directory / "model.safetensors")), cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(dtype).eval().requires_grad_(False)


def load_for_inference(directory: Path, dtype: torch.dtype = torch.float32,
                       kernels: Kernels | None = None, kernel_window_max: int = KERNEL_WINDOW_MAX,
                       fused_attention: bool = True, kernel_threads: KernelThreads = ONE_THREAD,
                       math: str = "fp32") -> Transformer:
    """load_model with the projections fused for decoding (not for training: the copies would drift);
    with kernels (float32 only), the fast step (see Transformer.fuse_for_inference), its matrix products
    in `math`."""
    model = load_model(directory, dtype)
    model.fuse_for_inference(kernels if dtype == torch.float32 else None, kernel_window_max, fused_attention,
                             kernel_threads, math)
    return model
