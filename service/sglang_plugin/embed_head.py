"""What SGLang 0.5.23's Qwen2-MoE target lacks for EAGLE/EAGLE-3 drafts: `get_embed_and_head`.

Every EAGLE-family draft worker of 0.5.23 (eagle_worker_v2, multi_layer_eagle_worker_v2,
frozen_kv_mtp_worker_v2) asks the target for its input embedding and LM head through one function,
`speculative/pp_draft_embedding.py:resolve_target_embed_and_head`, which calls
`target_model.get_embed_and_head()`. `Qwen2MoeForCausalLM` (models/qwen2_moe.py) has no such method
(Qwen3MoeForCausalLM has: `return self.model.embed_tokens.weight, self.lm_head.weight`), so the
draft worker's `init_lm_head` dies with an AttributeError. This AROUND hook answers that one question
for a Qwen2-MoE target the same way Qwen3-MoE's method does, and leaves every other target to SGLang.
Nothing else of EAGLE-3 is missing on the target: `set_eagle3_layers_to_capture` and the aux
hidden-state capture in its forward are there.
"""

from __future__ import annotations

QWEN2_MOE_CLASS = "Qwen2MoeForCausalLM"


def resolve_target_embed_and_head(original, target_model, *args, **kwargs):
    """AROUND hook of resolve_target_embed_and_head(target_model, *, draft_model=None)."""
    if hasattr(target_model, "get_embed_and_head") or type(target_model).__name__ != QWEN2_MOE_CLASS:
        return original(target_model, *args, **kwargs)
    return target_model.model.embed_tokens.weight, target_model.lm_head.weight
