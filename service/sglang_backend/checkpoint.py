"""Give SGLang a checkpoint it loads correctly: add lm_head.weight where SGLang would not tie it.

SGLang 0.5.23's Qwen2MoeForCausalLM (python/sglang/srt/models/qwen2_moe.py) always builds its own
ParallelLMHead and never reads `tie_word_embeddings` (its dense Qwen2 does). A tied Qwen2-MoE
checkpoint without lm_head.weight (transformers' save_pretrained drops a tied head) would then serve
with an uninitialised head. For such a directory this module builds a view next to it in a temp dir:
symlinks to every original file plus `lm_head.safetensors` holding a copy of
model.embed_tokens.weight. Other checkpoints are served from where they are, and that includes
moespec's own shipped target: service/engine/model/weights.py writes lm_head.weight even when tied, so it
needs no view (checked against the real SGLang on CPU: its greedy output equals the embedded
engine's).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from service.sglang_backend.model_config import ModelDirError

UNTIED_IN_SGLANG = ("qwen2_moe",)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def needs_head(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") not in UNTIED_IN_SGLANG or not config.get("tie_word_embeddings"):
        return False
    return not any(HEAD in _keys(f) for f in Path(model_dir).glob("*.safetensors"))


def sglang_model_dir(model_dir: Path) -> tuple[Path, bool]:
    """(the directory to give SGLang, whether it is a temp view the caller should remove)."""
    model_dir = Path(model_dir).resolve()
    if not needs_head(model_dir):
        return model_dir, False
    if (model_dir / "model.safetensors.index.json").exists():
        raise ModelDirError(f"{model_dir}: tied Qwen2-MoE checkpoint without lm_head.weight in a sharded index; "
                            "SGLang would not tie it. Save lm_head.weight into the checkpoint.")
    source = next((f for f in model_dir.glob("*.safetensors") if EMBED in _keys(f)), None)
    if source is None:
        raise ModelDirError(f"{model_dir}: no {EMBED} to tie lm_head to")
    view = Path(tempfile.mkdtemp(prefix="moespec-sglang-model-"))
    for f in model_dir.iterdir():
        (view / f.name).symlink_to(f)
    with safe_open(str(source), framework="pt") as st:
        embed = st.get_tensor(EMBED)
    save_file({HEAD: embed.clone()}, str(view / "lm_head.safetensors"))
    return view, True


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as st:
        return set(st.keys())
