"""A tied Qwen2-MoE checkpoint without lm_head.weight (as transformers' save_pretrained writes it) is
served to SGLang through a view that adds the head, because SGLang's Qwen2MoeForCausalLM never ties
it. The shipped target has the head and is served as is."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.sglang_backend.checkpoint import needs_head, sglang_model_dir
from service.sglang_backend.model_config import ModelDirError


def checkpoint(path, tie=True, model_type="qwen2_moe", head=False):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "tie_word_embeddings": tie}))
    (path / "tokenizer.json").write_text("{}")
    tensors = {"model.embed_tokens.weight": torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)}
    if head:
        tensors["lm_head.weight"] = torch.zeros(4, 3, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_tied_qwen2_moe_without_head_gets_a_view_with_the_embedding_as_head(tmp_path):
    original = checkpoint(tmp_path / "target")
    view, temp = sglang_model_dir(original)
    assert temp and view != original
    assert (view / "config.json").resolve() == (original / "config.json").resolve()
    assert (view / "tokenizer.json").is_symlink()
    with safe_open(str(view / "lm_head.safetensors"), framework="pt") as st:
        assert torch.equal(st.get_tensor("lm_head.weight"), torch.arange(12, dtype=torch.bfloat16).reshape(4, 3))
    assert not needs_head(view)  # the view is what SGLang loads, and it has the head now


@pytest.mark.parametrize("kwargs", [dict(tie=False), dict(model_type="qwen2"), dict(head=True)])
def test_other_checkpoints_are_served_where_they_are(tmp_path, kwargs):
    original = checkpoint(tmp_path / "m", **kwargs)
    assert sglang_model_dir(original) == (original.resolve(), False)


def test_a_sharded_tied_checkpoint_is_refused_with_the_fix(tmp_path):
    original = checkpoint(tmp_path / "m")
    (original / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelDirError, match="Save lm_head.weight"):
        sglang_model_dir(original)


def test_the_shipped_target_has_its_head_and_needs_no_view():
    # Finding 6 (sglang-cpu-notes): the docs said the shipped target lacked lm_head.weight.
    from service.engine.model.weights import MODELS_DIR

    target = MODELS_DIR / "target"
    with safe_open(str(target / "model.safetensors"), framework="pt") as st:
        names = list(st.keys())  # a safetensors handle, not a dict
    assert "lm_head.weight" in names
    assert sglang_model_dir(target) == (target.resolve(), False)
