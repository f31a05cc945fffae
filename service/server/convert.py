"""Protobuf <-> dataclass conversion for the moespec.v1 API, both directions, nothing else.

Contract: `*_from_pb` never validates (the dataclasses' `validate()` does that, so every entry point
refuses bad input with the same message); unset `optional` fields take the dataclass defaults. The
only error raised here is InvalidRequest for a value the dataclass cannot even hold (an unknown
drafter or controller enum number).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.policy.traffic import TrafficArm, TrafficSplit
from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from service.types import (
    MAX_DRAFT_TEMPERATURE,
    Controller,
    Drafter,
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    ModelInfo,
    PolicyCell,
    RequestKind,
    SamplingParams,
    SpecStats,
    new_token_budget,
)

DEFAULT_MAX_NEW_TOKENS = GenerationRequest().max_new_tokens


@dataclass(frozen=True)
class Budget:
    """The token budget a request ran with, as the response reports it."""

    max_new_tokens: int  # after the cut to the context's room
    cut: bool  # the cut made it smaller than the request asked

    @classmethod
    def of(cls, request: GenerationRequest, prompt_tokens: int, max_context: int) -> Budget:
        budget = new_token_budget(request.max_new_tokens, prompt_tokens, max_context)
        return cls(budget, budget < request.max_new_tokens)


_DRAFTER_TO_PB = {Drafter.MODEL: pb.DraftPolicy.MODEL, Drafter.NGRAM: pb.DraftPolicy.NGRAM}
_DRAFTER_FROM_PB = {v: k for k, v in _DRAFTER_TO_PB.items()}
_CONTROLLER_TO_PB = {
    Controller.STATIC: pb.DraftPolicy.STATIC,
    Controller.MOESPEC: pb.DraftPolicy.MOESPEC,
    Controller.SGLANG: pb.DraftPolicy.SGLANG_EMA,
    Controller.TRANSFORMERS: pb.DraftPolicy.TRANSFORMERS_HEURISTIC,
    Controller.CASCADE: pb.DraftPolicy.CASCADE,
}
_CONTROLLER_FROM_PB = {v: k for k, v in _CONTROLLER_TO_PB.items()}


def drafter_from_pb(value: int, field_name: str = "policy.drafter") -> Drafter:
    # proto3 enums are open: an unknown number arrives intact and must be refused here.
    try:
        return _DRAFTER_FROM_PB[value]
    except KeyError:
        raise InvalidRequest(field_name, f"unknown drafter {value}") from None


def drafter_to_pb(drafter: Drafter) -> int:
    return _DRAFTER_TO_PB[drafter]


def controller_from_pb(value: int, field_name: str = "policy.controller") -> Controller:
    try:
        return _CONTROLLER_FROM_PB[value]
    except KeyError:
        raise InvalidRequest(field_name, f"unknown controller {value}") from None


# -- requests ---------------------------------------------------------------------------------


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    d = SamplingParams()
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else d.top_k,
        seed=msg.seed if msg.HasField("seed") else d.seed,
    )


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def request_from_pb(msg: pb.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(
        prompt=msg.prompt,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
        sampling=sampling_from_pb(msg.sampling),
        stop=tuple(msg.stop),
    )


def request_to_pb(request: GenerationRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids),
        max_new_tokens=request.max_new_tokens,
        sampling=sampling_to_pb(request.sampling),
        stop=list(request.stop),
    )


# -- policy -----------------------------------------------------------------------------------


_KIND_TO_PB = {RequestKind.ANY: pb.PolicyCell.ANY, RequestKind.GREEDY: pb.PolicyCell.GREEDY,
               RequestKind.SAMPLED: pb.PolicyCell.SAMPLED}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def cell_from_pb(msg: pb.PolicyCell, field_prefix: str) -> PolicyCell:
    if msg.kind not in _KIND_FROM_PB:
        raise InvalidRequest(f"{field_prefix}.kind", f"unknown request kind {msg.kind}")
    return PolicyCell(policy=policy_from_pb(msg.policy, f"{field_prefix}.policy"), min_batch=msg.min_batch or 1,
                      max_batch=msg.max_batch, kind=_KIND_FROM_PB[msg.kind])


def policy_from_pb(msg: pb.DraftPolicy, field_prefix: str = "policy") -> DraftPolicy:
    d = DraftPolicy()
    return DraftPolicy(
        cells=tuple(cell_from_pb(c, f"{field_prefix}.cells[{i}]") for i, c in enumerate(msg.cells)),
        drafter=drafter_from_pb(msg.drafter, f"{field_prefix}.drafter"),
        draft_length=msg.draft_length,
        draft_temperature=msg.draft_temperature if msg.HasField("draft_temperature") else d.draft_temperature,
        policy_id=msg.policy_id,
        controller=controller_from_pb(msg.controller, f"{field_prefix}.controller"),
        cost_weight=msg.cost_weight if msg.HasField("cost_weight") else d.cost_weight,
        # 0 (unset: an older client) is a chain; a negative width stays as sent, for validate() to refuse.
        tree_width=msg.tree_width or d.tree_width,
    )


def policy_to_pb(policy: DraftPolicy) -> pb.DraftPolicy:
    return pb.DraftPolicy(
        drafter=drafter_to_pb(policy.drafter),
        draft_length=policy.draft_length,
        draft_temperature=policy.draft_temperature,
        policy_id=policy.policy_id,
        controller=_CONTROLLER_TO_PB[policy.controller],
        cost_weight=policy.cost_weight,
        cells=[pb.PolicyCell(min_batch=c.min_batch, max_batch=c.max_batch, kind=_KIND_TO_PB[c.kind],
                             policy=policy_to_pb(c.policy)) for c in policy.cells],
        tree_width=_width_to_pb(policy.tree_width),
    )


def _width_to_pb(width: int) -> int:
    """A chain is sent as 0 (the proto's unset): chain policies and stats stay what they were on the wire."""
    return 0 if width == 1 else width


def split_from_pb(msg: pb.TrafficSplit) -> TrafficSplit:
    arms = []
    for i, arm in enumerate(msg.arms):
        if not arm.HasField("policy"):
            raise InvalidRequest(f"split.arms[{i}].policy", "is missing")
        arms.append(TrafficArm(policy_from_pb(arm.policy, f"split.arms[{i}].policy"), arm.weight))
    return TrafficSplit(tuple(arms), msg.seed if msg.HasField("seed") else None)


def split_to_pb(split: TrafficSplit) -> pb.TrafficSplit:
    msg = pb.TrafficSplit(arms=[pb.TrafficArm(policy=policy_to_pb(a.policy), weight=a.weight) for a in split.arms])
    if split.seed is not None:
        msg.seed = split.seed
    return msg


# -- results ----------------------------------------------------------------------------------


def spec_to_pb(spec: SpecStats) -> pb.SpecStats:
    return pb.SpecStats(
        verify_steps=spec.verify_steps,
        drafted_tokens=spec.drafted_tokens,
        accepted_tokens=spec.accepted_tokens,
        committed_tokens=spec.committed_tokens,
        accepted_per_position=list(spec.accepted_per_position),
        unique_experts_mean=list(spec.unique_experts_mean),
        unique_experts_max=list(spec.unique_experts_max),
        draft_seconds=spec.draft_seconds,
        verify_seconds=spec.verify_seconds,
        seconds_per_committed_token=spec.seconds_per_committed_token,
        policy_id=spec.policy_id,
        empty_drafts=spec.empty_drafts,
        drafter=drafter_to_pb(spec.drafter),
        draft_length=spec.draft_length,
        draft_temperature=spec.draft_temperature,
        controller=_CONTROLLER_TO_PB[spec.controller],
        tree_width=_width_to_pb(spec.tree_width),
        branch_unique_experts_mean=list(spec.branch_unique_experts_mean),
    )


def spec_from_pb(msg: pb.SpecStats) -> SpecStats:
    # seconds_per_committed_token is derived by the dataclass, so it is not read back.
    return SpecStats(
        verify_steps=msg.verify_steps,
        drafted_tokens=msg.drafted_tokens,
        accepted_tokens=msg.accepted_tokens,
        committed_tokens=msg.committed_tokens,
        accepted_per_position=tuple(msg.accepted_per_position),
        unique_experts_mean=tuple(msg.unique_experts_mean),
        unique_experts_max=tuple(msg.unique_experts_max),
        draft_seconds=msg.draft_seconds,
        verify_seconds=msg.verify_seconds,
        empty_drafts=msg.empty_drafts,
        policy_id=msg.policy_id,
        drafter=drafter_from_pb(msg.drafter, "spec.drafter"),
        draft_length=msg.draft_length,
        draft_temperature=msg.draft_temperature,
        controller=controller_from_pb(msg.controller, "spec.controller"),
        tree_width=msg.tree_width or 1,
        branch_unique_experts_mean=tuple(msg.branch_unique_experts_mean),
    )


def response_to_pb(result: GenerationResult, trace_id: str, budget: Budget) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=result.text,
        token_ids=list(result.token_ids),
        finish_reason=result.finish_reason.value,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        trace_id=trace_id,
        spec=spec_to_pb(result.spec),
        seconds=result.seconds,
        time_to_first_token=result.time_to_first_token,
        max_new_tokens=budget.max_new_tokens,
        max_new_tokens_cut=budget.cut,
    )


def final_chunk_to_pb(
    result: GenerationResult, trace_id: str, budget: Budget, text: str, token_ids: tuple[int, ...]
) -> pb.GenerateChunk:
    """The stream's last chunk: the unary response's summary plus whatever was not yet streamed."""
    return pb.GenerateChunk(
        text=text,
        token_ids=list(token_ids),
        finish_reason=result.finish_reason.value,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        trace_id=trace_id,
        spec=spec_to_pb(result.spec),
        seconds=result.seconds,
        time_to_first_token=result.time_to_first_token,
        max_new_tokens=budget.max_new_tokens,
        max_new_tokens_cut=budget.cut,
    )


def finish_reason_from_pb(value: str) -> FinishReason:
    return FinishReason(value)


# -- model info -------------------------------------------------------------------------------


def info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        backend=info.backend,
        model_name=info.model_name,
        draft_model_name=info.draft_model_name,
        num_layers=info.num_layers,
        num_experts=info.num_experts,
        top_k=info.top_k,
        shared_experts=info.shared_experts,
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        max_draft_length=info.max_draft_length,
        drafters=[drafter_to_pb(d) for d in info.drafters],
        tunable=list(info.tunable),
        expert_bytes=info.expert_bytes,
        decode_step_seconds=info.decode_step_seconds,
        max_draft_temperature=MAX_DRAFT_TEMPERATURE,
        policy_switch_seconds=info.policy_switch_seconds,
        policy_switches=info.policy_switches,
        prepared_draft_lengths=list(info.prepared_draft_lengths),
        length_switch_seconds=info.length_switch_seconds,
        length_switches=info.length_switches,
        concurrent_policies=info.concurrent_policies,
        device=info.device,
        shared_passes=info.shared_passes,
        instance_id=info.instance_id,
        controllers=[_CONTROLLER_TO_PB[c] for c in info.controllers],
        controllers_note=info.controllers_note,
        policy_tables=info.policy_tables,
        max_tree_width=info.max_tree_width,
    )


def info_from_pb(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        backend=msg.backend,
        model_name=msg.model_name,
        draft_model_name=msg.draft_model_name,
        num_layers=msg.num_layers,
        num_experts=msg.num_experts,
        top_k=msg.top_k,
        shared_experts=msg.shared_experts,
        vocab_size=msg.vocab_size,
        max_context=msg.max_context,
        max_draft_length=msg.max_draft_length,
        drafters=tuple(drafter_from_pb(d, "drafters") for d in msg.drafters),
        tunable=tuple(msg.tunable),
        expert_bytes=msg.expert_bytes,
        decode_step_seconds=msg.decode_step_seconds,
        policy_switch_seconds=msg.policy_switch_seconds,
        policy_switches=msg.policy_switches,
        prepared_draft_lengths=tuple(msg.prepared_draft_lengths),
        length_switch_seconds=msg.length_switch_seconds,
        length_switches=msg.length_switches,
        concurrent_policies=msg.concurrent_policies,
        device=msg.device,
        shared_passes=msg.shared_passes,
        instance_id=msg.instance_id,
        # A server that predates controllers offers the static one only.
        controllers=tuple(controller_from_pb(c, "controllers") for c in msg.controllers) or (Controller.STATIC,),
        controllers_note=msg.controllers_note,
        policy_tables=msg.policy_tables,
        max_tree_width=msg.max_tree_width or 1,  # a server that predates trees drafts chains
    )
