"""The engine's model reproduces transformers' Qwen2-MoE / Qwen2 logits on the shipped files."""

from __future__ import annotations

import pytest
import torch

from service.engine import kernels
from service.engine.model import KVCache
from service.engine.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_for_inference, load_model

transformers = pytest.importorskip("transformers")

TEXT = "import os\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"


def load_fast(directory):
    """The fast step: the fused expert kernel (must build here: a silent eager fallback would pass)."""
    built = kernels.build()
    assert built is not None, "the fused kernel did not build"
    return load_for_inference(directory, kernels=built)


@pytest.mark.parametrize("loader", [load_model, load_for_inference, load_fast], ids=["plain", "fused", "fast"])
@pytest.mark.parametrize("directory", [DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["target", "draft"])
def test_logits_match_transformers_through_the_static_cache(directory, loader):
    oracle = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    model = loader(directory)
    cache = KVCache(model.cfg, 128)
    with torch.no_grad():
        expected = oracle(ids[None]).logits[0]
        # A prefill, a 5-token window and single-token steps: the three ways the engine calls it.
        pieces = [model.forward(ids[:10], 0, cache).logits, model.forward(ids[10:15], 10, cache).logits]
        pieces += [model.forward(ids[i:i + 1], i, cache).logits for i in range(15, ids.shape[0])]
    got = torch.cat(pieces)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_shipped_tokenizer_is_the_same_for_transformers_and_the_engine():
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))
    for directory in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR):
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
        assert theirs(TEXT)["input_ids"] == ours.encode(TEXT).ids
        assert theirs.decode(ours.encode(TEXT).ids) == TEXT


def test_shipped_models_fit_the_size_budget():
    total = sum((d / "model.safetensors").stat().st_size for d in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR))
    assert total <= 60 * 2**20
