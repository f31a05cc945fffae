"""The ModelInfo the SGLang backend reports; `policy_switch_seconds` / `policy_switches` start at 0
and are updated by the backend each time a policy change swaps engines, `length_switch_seconds` /
`length_switches` each time one pins a prepared draft length instead (see backend.py)."""

from __future__ import annotations

from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.policy import SpecConfig, max_tree_width, tunable_knobs
from service.types import MAX_DRAFT_LENGTH, Controller, ModelInfo


def build_info(target: MoeGeometry, draft_name: str, spec: SpecConfig, max_context: int,
               decode_step_seconds: float = 0.0, device: str = "cuda") -> ModelInfo:
    return ModelInfo(
        backend="sglang",
        model_name=target.name,
        draft_model_name=draft_name,
        num_layers=len(target.moe_layers),
        num_experts=target.num_experts,
        top_k=target.top_k,
        shared_experts=target.shared_experts,
        vocab_size=target.vocab_size,
        max_context=max_context,
        max_draft_length=MAX_DRAFT_LENGTH,
        drafters=spec.drafters(),
        tunable=tunable_knobs(spec),
        expert_bytes=target.expert_bytes,
        decode_step_seconds=decode_step_seconds,
        concurrent_policies=False,  # speculation is fixed at engine start-up: one policy at a time
        shared_passes=True,  # SGLang's scheduler batches the requests in flight into shared passes
        device=device,
        # moespec's per-step controllers run in the torch backend. SGLang's own acceptance rule
        # (--speculative-adaptive) would fight the tuner: moespec pins its step count instead.
        controllers=(Controller.STATIC,),
        controllers_note=("per-step draft-length controllers run in the torch backend; SGLang's EAGLE/EAGLE3 "
                          "engines switch among prepared_draft_lengths at run time, set by SetPolicy or the "
                          "tuner, never by SGLang's own acceptance rule"),
        prepared_draft_lengths=spec.prepared_lengths,
        max_tree_width=max_tree_width(spec),  # EAGLE/EAGLE3 engines draft trees (speculative_eagle_topk)
    )
