from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "stop")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("verify_steps", "drafted_tokens", "accepted_tokens", "committed_tokens", "accepted_per_position", "unique_experts_mean", "unique_experts_max", "draft_seconds", "verify_seconds", "seconds_per_committed_token", "policy_id", "empty_drafts", "drafter", "draft_length", "draft_temperature", "controller", "tree_width", "branch_unique_experts_mean")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_EXPERTS_MEAN_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_EXPERTS_MAX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_COMMITTED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    EMPTY_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BRANCH_UNIQUE_EXPERTS_MEAN_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    committed_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    unique_experts_mean: _containers.RepeatedScalarFieldContainer[float]
    unique_experts_max: _containers.RepeatedScalarFieldContainer[int]
    draft_seconds: float
    verify_seconds: float
    seconds_per_committed_token: float
    policy_id: str
    empty_drafts: int
    drafter: DraftPolicy.Drafter
    draft_length: int
    draft_temperature: float
    controller: DraftPolicy.Controller
    tree_width: int
    branch_unique_experts_mean: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, verify_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., unique_experts_mean: _Optional[_Iterable[float]] = ..., unique_experts_max: _Optional[_Iterable[int]] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., seconds_per_committed_token: _Optional[float] = ..., policy_id: _Optional[str] = ..., empty_drafts: _Optional[int] = ..., drafter: _Optional[_Union[DraftPolicy.Drafter, str]] = ..., draft_length: _Optional[int] = ..., draft_temperature: _Optional[float] = ..., controller: _Optional[_Union[DraftPolicy.Controller, str]] = ..., tree_width: _Optional[int] = ..., branch_unique_experts_mean: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "trace_id", "spec", "seconds", "time_to_first_token", "max_new_tokens", "max_new_tokens_cut")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_CUT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    trace_id: str
    spec: SpecStats
    seconds: float
    time_to_first_token: float
    max_new_tokens: int
    max_new_tokens_cut: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., trace_id: _Optional[str] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., seconds: _Optional[float] = ..., time_to_first_token: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., max_new_tokens_cut: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "trace_id", "spec", "seconds", "time_to_first_token", "max_new_tokens", "max_new_tokens_cut")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_CUT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    trace_id: str
    spec: SpecStats
    seconds: float
    time_to_first_token: float
    max_new_tokens: int
    max_new_tokens_cut: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., trace_id: _Optional[str] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., seconds: _Optional[float] = ..., time_to_first_token: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., max_new_tokens_cut: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("backend", "model_name", "draft_model_name", "num_layers", "num_experts", "top_k", "shared_experts", "vocab_size", "max_context", "max_draft_length", "drafters", "tunable", "expert_bytes", "decode_step_seconds", "max_draft_temperature", "policy_switch_seconds", "policy_switches", "concurrent_policies", "device", "shared_passes", "instance_id", "controllers", "controllers_note", "policy_tables", "prepared_draft_lengths", "length_switch_seconds", "length_switches", "max_tree_width")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    TUNABLE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    POLICY_SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    CONCURRENT_POLICIES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHARED_PASSES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLERS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLERS_NOTE_FIELD_NUMBER: _ClassVar[int]
    POLICY_TABLES_FIELD_NUMBER: _ClassVar[int]
    PREPARED_DRAFT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model_name: str
    draft_model_name: str
    num_layers: int
    num_experts: int
    top_k: int
    shared_experts: int
    vocab_size: int
    max_context: int
    max_draft_length: int
    drafters: _containers.RepeatedScalarFieldContainer[DraftPolicy.Drafter]
    tunable: _containers.RepeatedScalarFieldContainer[str]
    expert_bytes: int
    decode_step_seconds: float
    max_draft_temperature: float
    policy_switch_seconds: float
    policy_switches: int
    concurrent_policies: bool
    device: str
    shared_passes: bool
    instance_id: str
    controllers: _containers.RepeatedScalarFieldContainer[DraftPolicy.Controller]
    controllers_note: str
    policy_tables: bool
    prepared_draft_lengths: _containers.RepeatedScalarFieldContainer[int]
    length_switch_seconds: float
    length_switches: int
    max_tree_width: int
    def __init__(self, backend: _Optional[str] = ..., model_name: _Optional[str] = ..., draft_model_name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., shared_experts: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_draft_length: _Optional[int] = ..., drafters: _Optional[_Iterable[_Union[DraftPolicy.Drafter, str]]] = ..., tunable: _Optional[_Iterable[str]] = ..., expert_bytes: _Optional[int] = ..., decode_step_seconds: _Optional[float] = ..., max_draft_temperature: _Optional[float] = ..., policy_switch_seconds: _Optional[float] = ..., policy_switches: _Optional[int] = ..., concurrent_policies: _Optional[bool] = ..., device: _Optional[str] = ..., shared_passes: _Optional[bool] = ..., instance_id: _Optional[str] = ..., controllers: _Optional[_Iterable[_Union[DraftPolicy.Controller, str]]] = ..., controllers_note: _Optional[str] = ..., policy_tables: _Optional[bool] = ..., prepared_draft_lengths: _Optional[_Iterable[int]] = ..., length_switch_seconds: _Optional[float] = ..., length_switches: _Optional[int] = ..., max_tree_width: _Optional[int] = ...) -> None: ...

class DraftPolicy(_message.Message):
    __slots__ = ("drafter", "draft_length", "draft_temperature", "policy_id", "controller", "cost_weight", "cells", "tree_width")
    class Drafter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODEL: _ClassVar[DraftPolicy.Drafter]
        NGRAM: _ClassVar[DraftPolicy.Drafter]
    MODEL: DraftPolicy.Drafter
    NGRAM: DraftPolicy.Drafter
    class Controller(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATIC: _ClassVar[DraftPolicy.Controller]
        MOESPEC: _ClassVar[DraftPolicy.Controller]
        SGLANG_EMA: _ClassVar[DraftPolicy.Controller]
        TRANSFORMERS_HEURISTIC: _ClassVar[DraftPolicy.Controller]
        CASCADE: _ClassVar[DraftPolicy.Controller]
    STATIC: DraftPolicy.Controller
    MOESPEC: DraftPolicy.Controller
    SGLANG_EMA: DraftPolicy.Controller
    TRANSFORMERS_HEURISTIC: DraftPolicy.Controller
    CASCADE: DraftPolicy.Controller
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    COST_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    drafter: DraftPolicy.Drafter
    draft_length: int
    draft_temperature: float
    policy_id: str
    controller: DraftPolicy.Controller
    cost_weight: float
    cells: _containers.RepeatedCompositeFieldContainer[PolicyCell]
    tree_width: int
    def __init__(self, drafter: _Optional[_Union[DraftPolicy.Drafter, str]] = ..., draft_length: _Optional[int] = ..., draft_temperature: _Optional[float] = ..., policy_id: _Optional[str] = ..., controller: _Optional[_Union[DraftPolicy.Controller, str]] = ..., cost_weight: _Optional[float] = ..., cells: _Optional[_Iterable[_Union[PolicyCell, _Mapping]]] = ..., tree_width: _Optional[int] = ...) -> None: ...

class PolicyCell(_message.Message):
    __slots__ = ("min_batch", "max_batch", "kind", "policy")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ANY: _ClassVar[PolicyCell.Kind]
        GREEDY: _ClassVar[PolicyCell.Kind]
        SAMPLED: _ClassVar[PolicyCell.Kind]
    ANY: PolicyCell.Kind
    GREEDY: PolicyCell.Kind
    SAMPLED: PolicyCell.Kind
    MIN_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    min_batch: int
    max_batch: int
    kind: PolicyCell.Kind
    policy: DraftPolicy
    def __init__(self, min_batch: _Optional[int] = ..., max_batch: _Optional[int] = ..., kind: _Optional[_Union[PolicyCell.Kind, str]] = ..., policy: _Optional[_Union[DraftPolicy, _Mapping]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: DraftPolicy
    def __init__(self, policy: _Optional[_Union[DraftPolicy, _Mapping]] = ...) -> None: ...

class TrafficArm(_message.Message):
    __slots__ = ("policy", "weight")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    policy: DraftPolicy
    weight: float
    def __init__(self, policy: _Optional[_Union[DraftPolicy, _Mapping]] = ..., weight: _Optional[float] = ...) -> None: ...

class TrafficSplit(_message.Message):
    __slots__ = ("arms", "seed")
    ARMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    arms: _containers.RepeatedCompositeFieldContainer[TrafficArm]
    seed: int
    def __init__(self, arms: _Optional[_Iterable[_Union[TrafficArm, _Mapping]]] = ..., seed: _Optional[int] = ...) -> None: ...

class SetTrafficSplitRequest(_message.Message):
    __slots__ = ("split",)
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    split: TrafficSplit
    def __init__(self, split: _Optional[_Union[TrafficSplit, _Mapping]] = ...) -> None: ...

class GetTrafficSplitRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
