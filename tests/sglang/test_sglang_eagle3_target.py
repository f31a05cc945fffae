"""EAGLE-3 on the SGLang backend without SGLang: which engines switch the plugin's target
embedding/head lookup on, what that lookup answers, and where the EAGLE3 draft comes from by default.
The real thing (SGLang's draft worker asking a Qwen2-MoE target) runs in test_sglang_cpu_eagle3.py."""

from __future__ import annotations

import pytest
from torch import nn

from service.errors import UsageError
from service.sglang_backend import cli as sglang_cli
from service.sglang_backend import create_backend
from service.sglang_backend.policy import SpecConfig, needs_eagle_target, speculative_kwargs
from service.sglang_plugin.embed_head import resolve_target_embed_and_head
from service.types import Drafter, DraftPolicy
from tests.sglang.test_sglang_errors import model_dir, parse


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 4)


class Qwen2MoeForCausalLM(nn.Module):
    """Named as SGLang's class, shaped as it: `model.embed_tokens` and `lm_head`, no get_embed_and_head."""

    def __init__(self):
        super().__init__()
        self.model = _Inner()
        self.lm_head = nn.Linear(4, 16, bias=False)


def sglangs_own(target_model, *, draft_model=None):
    """What SGLang's resolve_target_embed_and_head does for a target without a draft-specific lookup."""
    return target_model.get_embed_and_head()


def test_a_qwen2_moe_target_answers_with_its_own_embedding_and_head():
    target = Qwen2MoeForCausalLM()
    embed, head = resolve_target_embed_and_head(sglangs_own, target, draft_model=None)
    assert embed is target.model.embed_tokens.weight and head is target.lm_head.weight  # shared, not copied
    with pytest.raises(AttributeError, match="get_embed_and_head"):  # what SGLang alone does with it
        sglangs_own(target)


def test_other_targets_are_left_to_sglang():
    class WithMethod(Qwen2MoeForCausalLM):
        def get_embed_and_head(self):
            return "its own", "answer"

    class Qwen3MoeForCausalLM(nn.Module):
        pass

    assert resolve_target_embed_and_head(sglangs_own, WithMethod()) == ("its own", "answer")
    with pytest.raises(AttributeError):
        resolve_target_embed_and_head(sglangs_own, Qwen3MoeForCausalLM())


@pytest.mark.parametrize(("algorithm", "needed"), [("EAGLE3", True), ("EAGLE", True), ("STANDALONE", False)])
def test_the_lookup_is_switched_on_for_eagle_engines_only(algorithm, needed):
    spec = SpecConfig(model_algorithm=algorithm, draft_model_path="/drafts/d")
    assert needs_eagle_target(speculative_kwargs(DraftPolicy(Drafter.MODEL, draft_length=3), spec)) is needed
    assert not needs_eagle_target(speculative_kwargs(DraftPolicy(draft_length=0), spec))  # plain: no draft
    assert not needs_eagle_target(speculative_kwargs(DraftPolicy(Drafter.NGRAM, draft_length=3), spec))


def test_eagle3_without_a_draft_path_uses_the_shipped_draft_directory(tmp_path, monkeypatch):
    shipped = tmp_path / "models" / "eagle3"
    monkeypatch.setattr(sglang_cli, "DEFAULT_EAGLE3_DRAFT", shipped)
    monkeypatch.setattr(sglang_cli, "import_sglang", lambda: pytest.fail("sglang imported before the draft check"))
    with pytest.raises(UsageError) as e:
        create_backend(parse("--model-path", model_dir(tmp_path / "t"), "--speculative-algorithm", "EAGLE3"))
    assert str(e.value) == f"--draft-model-path {shipped}: no such directory (give a local model directory)"
