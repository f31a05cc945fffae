"""The ModelInfo the SGLang backend reports, with the measured cost of changing policy.

`policy_switch_seconds` is not (yet) a field of service.types.ModelInfo or of the proto; this
subclass carries it so in-process readers (bench, tests, a tuner embedded in the server) can use it
now, and the servicer can forward it once the proto has the field (see the README).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.policy import SpecConfig, tunable_knobs
from service.types import MAX_DRAFT_LENGTH, ModelInfo


@dataclass(frozen=True)
class SGLangModelInfo(ModelInfo):
    # Wall time of the last engine swap (stop + start + warm-up) a policy change caused; 0.0 until
    # one was measured. A tuner should charge it to the trial that needs the swap.
    policy_switch_seconds: float = 0.0
    policy_switches: int = 0


def build_info(target: MoeGeometry, draft_name: str, spec: SpecConfig, max_context: int,
               decode_step_seconds: float = 0.0) -> SGLangModelInfo:
    return SGLangModelInfo(
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
    )
