"""Every span name, attribute key, metric name, unit and bucket list moespec emits, in one place.

These names are the public contract of ARCHITECTURE.md ("OpenTelemetry"): the tuner, the Grafana
dashboard and the tests are written against them, so code elsewhere refers to these constants and
never spells a key itself. `prometheus_name` gives the name a metric has once the Prometheus
exporter (ours or the Collector's) has translated it, so dashboards can be checked against this file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

# ---------------------------------------------------------------- span names
GEN_AI_OPERATION = "text_completion"
VERIFY_SPAN_NAME = "verify"
VERIFY_BATCH_SPAN_NAME = "verify_batch"  # one continuous-batching pass, linked to the request spans it served


def request_span_name(model: str) -> str:
    """GenAI convention: '{gen_ai.operation.name} {gen_ai.request.model}'."""
    return f"{GEN_AI_OPERATION} {model}"


# ------------------------------------------------ GenAI semantic-convention keys
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
ERROR_TYPE = "error.type"

# A self-hosted server is its own provider; the conventions let custom providers name themselves.
GEN_AI_PROVIDER = "moespec"

# ------------------------------------------------------- moespec request aggregates
SPEC_POLICY_ID = "moespec.spec.policy_id"
SPEC_DRAFTER = "moespec.spec.drafter"
SPEC_DRAFT_LENGTH = "moespec.spec.draft_length"
SPEC_DRAFT_TEMPERATURE = "moespec.spec.draft_temperature"
# Who picked each step's draft length ("static", "moespec", "sglang-ema", ...): request and verify spans.
SPEC_CONTROLLER = "moespec.spec.controller"
# The label of the table cell whose policy a step ran ("b1-1.greedy"): verify spans and the drafted
# tokens histogram, only for steps that ran a cell of a table policy.
SPEC_CELL = "moespec.spec.cell"
# Draft trees (DraftPolicy.tree_width > 1): the policy's tree width (request span: under a tree policy;
# verify span: on a step that drafted a tree), and on the verify span the deepest draft's depth (the
# longest path the step could accept) and the tree's root-to-leaf branch count.
SPEC_TREE_WIDTH = "moespec.spec.tree_width"
SPEC_TREE_DEPTH = "moespec.spec.tree_depth"
SPEC_TREE_BRANCHES = "moespec.spec.tree_branches"
SPEC_VERIFY_STEPS = "moespec.spec.verify_steps"
SPEC_DRAFTED_TOKENS = "moespec.spec.drafted_tokens"
SPEC_ACCEPTED_TOKENS = "moespec.spec.accepted_tokens"
SPEC_COMMITTED_TOKENS = "moespec.spec.committed_tokens"
# Beyond the architecture note: steps where the drafter proposed nothing (n-gram found no match).
SPEC_EMPTY_DRAFTS = "moespec.spec.empty_drafts"
MOE_UNIQUE_EXPERTS_MEAN = "moespec.moe.unique_experts_mean"  # double[L]
MOE_UNIQUE_EXPERTS_MAX = "moespec.moe.unique_experts_max"  # int[L]
COST_DRAFT_SECONDS = "moespec.cost.draft_seconds"
COST_VERIFY_SECONDS = "moespec.cost.verify_seconds"
# Beyond the architecture note (continuous batching): the batch union of the passes that verified
# this request's steps, averaged over its steps, per layer. double[L]; absent when the backend
# reports no passes.
MOE_BATCH_UNIQUE_EXPERTS_MEAN = "moespec.moe.batch_unique_experts_mean"
# Draft trees: per layer, the distinct routed experts of one root-to-leaf branch of a tree (the
# window's first token and the drafts along it), beside the union over the whole tree
# (MOE_UNIQUE_EXPERTS): how much the siblings verified together widen the pass. double[L] mean over
# the branches (request span: over the steps, a chain step's one branch being its window), int[L]
# the widest branch (verify span only).
MOE_BRANCH_UNIQUE_EXPERTS_MEAN = "moespec.moe.branch_unique_experts_mean"
MOE_BRANCH_UNIQUE_EXPERTS_MAX = "moespec.moe.branch_unique_experts_max"

# ------------------------------------------------------------- verify-step span
MOE_UNIQUE_EXPERTS = "moespec.moe.unique_experts"  # int[L]
MOE_UNIQUE_EXPERTS_BOUND = "moespec.moe.unique_experts_bound"  # min(E, w*m)
MOE_SHARED_EXPERTS = "moespec.moe.shared_experts"
MOE_WIDEST_LAYER = "moespec.moe.widest_layer"
COST_DECODE_STEP_EQUIVALENTS = "moespec.cost.decode_step_equivalents"
# Beside the union, per layer: the mean and the smallest size of the pairwise intersections of the
# window positions' expert sets (one position: its own set's size); absent where the routing is not
# counted (an SGLang backend without its statistics).
MOE_PAIRWISE_OVERLAP_MEAN = "moespec.moe.pairwise_overlap_mean"  # double[L]
MOE_PAIRWISE_OVERLAP_MIN = "moespec.moe.pairwise_overlap_min"  # int[L]
# Expert-parallel estimate (issue 13; only when the server runs with --ep-size): per layer, the EP
# ranks a pass's routed pairs run on and the most distinct experts one rank runs; the bytes of the
# token-expert pairs dispatched off their home rank (all layers). See service/routing/expert_parallel.py.
MOE_EP_RANKS_TOUCHED = "moespec.moe.ep_ranks_touched"  # int[L] (verify span)
MOE_EP_MAX_RANK_EXPERTS = "moespec.moe.ep_max_rank_experts"  # int[L] (verify span)
MOE_EP_DISPATCH_BYTES = "moespec.moe.ep_dispatch_bytes"  # int (verify span: the pass; request span: the sum)
MOE_EP_RANKS_TOUCHED_MEAN = "moespec.moe.ep_ranks_touched_mean"  # double[L] (request span)
MOE_EP_MAX_RANK_EXPERTS_MAX = "moespec.moe.ep_max_rank_experts_max"  # int[L] (request span)
EP_VERIFY_SPAN_KEYS = (MOE_EP_RANKS_TOUCHED, MOE_EP_MAX_RANK_EXPERTS, MOE_EP_DISPATCH_BYTES)
TABLE_VERIFY_SPAN_KEYS = (SPEC_CELL,)  # only on steps that ran a table policy's cell
# only on steps that drafted a tree (chain steps' spans are unchanged)
TREE_VERIFY_SPAN_KEYS = (SPEC_TREE_WIDTH, SPEC_TREE_DEPTH, SPEC_TREE_BRANCHES, MOE_BRANCH_UNIQUE_EXPERTS_MEAN,
                         MOE_BRANCH_UNIQUE_EXPERTS_MAX)
TREE_POLICY_REQUEST_SPAN_KEYS = (SPEC_TREE_WIDTH,)  # only under a tree policy (tree_width > 1)
TREE_REQUEST_SPAN_KEYS = (MOE_BRANCH_UNIQUE_EXPERTS_MEAN,)  # only when a step of the request drafted a tree
EP_REQUEST_SPAN_KEYS = (MOE_EP_RANKS_TOUCHED_MEAN, MOE_EP_MAX_RANK_EXPERTS_MAX, MOE_EP_DISPATCH_BYTES)

# ---------------------------------------------------------- verify_batch span (one per sampled pass)
MOE_BATCH_UNIQUE_EXPERTS = "moespec.moe.batch_unique_experts"  # int[L] over every position of the pass
MOE_BATCH_UNIQUE_EXPERTS_BOUND = "moespec.moe.batch_unique_experts_bound"  # min(E, positions * m)
BATCH_SIZE = "moespec.batch.size"  # requests the pass served
BATCH_POSITIONS = "moespec.batch.positions"  # tokens in the pass (sum of the windows)
BATCH_WINDOWS = "moespec.batch.windows"  # int[batch size] each request's window
BATCH_PASS_ID = "moespec.batch.pass_id"
# The expert-parallel view of the whole pass (issue 13; only with --ep-size): the request view's
# quantities over every position of every request in the pass (see service/routing/expert_parallel.py).
MOE_BATCH_EP_RANKS_TOUCHED = "moespec.moe.batch_ep_ranks_touched"  # int[L]
MOE_BATCH_EP_MAX_RANK_EXPERTS = "moespec.moe.batch_ep_max_rank_experts"  # int[L]
MOE_BATCH_EP_DISPATCH_BYTES = "moespec.moe.batch_ep_dispatch_bytes"  # int, all layers
EP_VERIFY_BATCH_SPAN_KEYS = (MOE_BATCH_EP_RANKS_TOUCHED, MOE_BATCH_EP_MAX_RANK_EXPERTS, MOE_BATCH_EP_DISPATCH_BYTES)
# (it also carries COST_DRAFT_SECONDS and COST_VERIFY_SECONDS of the pass, and links to the request spans)
# (the verify span also carries SPEC_DRAFTER, SPEC_DRAFT_LENGTH, SPEC_CONTROLLER, SPEC_DRAFTED_TOKENS,
#  SPEC_ACCEPTED_TOKENS, SPEC_COMMITTED_TOKENS and COST_VERIFY_SECONDS, with per-step values: drafted
#  is the length the step used, draft_length the policy's most; and SPEC_CELL where a table's cell ran)

REQUEST_SPAN_KEYS = (
    GEN_AI_OPERATION_NAME, GEN_AI_PROVIDER_NAME, GEN_AI_REQUEST_MODEL, GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_MAX_TOKENS, GEN_AI_USAGE_INPUT_TOKENS, GEN_AI_USAGE_OUTPUT_TOKENS,
    GEN_AI_RESPONSE_FINISH_REASONS, SPEC_POLICY_ID, SPEC_DRAFTER, SPEC_DRAFT_LENGTH, SPEC_DRAFT_TEMPERATURE,
    SPEC_CONTROLLER, SPEC_VERIFY_STEPS, SPEC_DRAFTED_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_COMMITTED_TOKENS,
    SPEC_EMPTY_DRAFTS,
    MOE_UNIQUE_EXPERTS_MEAN, MOE_UNIQUE_EXPERTS_MAX, COST_DRAFT_SECONDS, COST_VERIFY_SECONDS,
    MOE_BATCH_UNIQUE_EXPERTS_MEAN,
)
VERIFY_SPAN_KEYS = (
    SPEC_DRAFTER, SPEC_DRAFT_LENGTH, SPEC_CONTROLLER, SPEC_DRAFTED_TOKENS, SPEC_ACCEPTED_TOKENS,
    SPEC_COMMITTED_TOKENS, MOE_UNIQUE_EXPERTS,
    MOE_UNIQUE_EXPERTS_BOUND, MOE_SHARED_EXPERTS, MOE_WIDEST_LAYER, COST_VERIFY_SECONDS,
    COST_DECODE_STEP_EQUIVALENTS, MOE_PAIRWISE_OVERLAP_MEAN, MOE_PAIRWISE_OVERLAP_MIN,
)
VERIFY_BATCH_SPAN_KEYS = (
    BATCH_PASS_ID, BATCH_SIZE, BATCH_POSITIONS, BATCH_WINDOWS, MOE_BATCH_UNIQUE_EXPERTS,
    MOE_BATCH_UNIQUE_EXPERTS_BOUND, COST_DRAFT_SECONDS, COST_VERIFY_SECONDS,
)

# ------------------------------------------------------------------ resource
# No semantic convention names a served model on the resource, so these live under moespec.
RESOURCE_SERVICE_NAME = "service.name"
# The semantic convention's replica identity: one value per server process (GetModelInfo.instance_id).
RESOURCE_SERVICE_INSTANCE_ID = "service.instance.id"
RESOURCE_MODEL_NAME = "moespec.model.name"
RESOURCE_DRAFT_MODEL_NAME = "moespec.model.draft"
RESOURCE_BACKEND = "moespec.backend"
RESOURCE_DEVICE = "moespec.device"  # where the backend computes ("cpu", "cuda"), when it says

# ---------------------------------------------------------- metric attributes
MOE_LAYER = "moespec.moe.layer"
STEP_METRIC_KEYS = (SPEC_POLICY_ID, SPEC_DRAFTER, SPEC_DRAFT_LENGTH)  # on every moespec.* step metric


# ------------------------------------------------------------------ metrics
class Kind(StrEnum):
    HISTOGRAM = "histogram"
    COUNTER = "counter"
    GAUGE = "gauge"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    unit: str
    description: str
    buckets: tuple[float, ...] | None = None  # None: derived from the model (see otel.metrics)
    attributes: tuple[str, ...] = ()


# Bucket boundaries advised by the GenAI semantic conventions (gen-ai-metrics.md).
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Verify cost in decode steps: 1 = as cheap as plain decoding; the note measured 1.3-3.6 on CPU.
DECODE_STEP_EQUIVALENT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024)

_GEN_AI_METRIC_KEYS = (GEN_AI_OPERATION_NAME, GEN_AI_PROVIDER_NAME, GEN_AI_REQUEST_MODEL)

REQUEST_DURATION = MetricSpec(
    "gen_ai.server.request.duration", Kind.HISTOGRAM, "s",
    "Generative AI server request duration such as time-to-last byte or last output token.",
    REQUEST_DURATION_BUCKETS, (*_GEN_AI_METRIC_KEYS, ERROR_TYPE))
TIME_TO_FIRST_TOKEN = MetricSpec(
    "gen_ai.server.time_to_first_token", Kind.HISTOGRAM, "s",
    "Time to generate first token for successful responses.", TIME_TO_FIRST_TOKEN_BUCKETS, _GEN_AI_METRIC_KEYS)
TIME_PER_OUTPUT_TOKEN = MetricSpec(
    "gen_ai.server.time_per_output_token", Kind.HISTOGRAM, "s",
    "Time per output token generated after the first token for successful responses.",
    TIME_PER_OUTPUT_TOKEN_BUCKETS, _GEN_AI_METRIC_KEYS)
STEP_ACCEPTED_TOKENS = MetricSpec(
    "moespec.spec.step.accepted_tokens", Kind.HISTOGRAM, "{token}",
    "Draft tokens the target accepted in one verify step.", None, STEP_METRIC_KEYS)
STEP_UNIQUE_EXPERTS = MetricSpec(
    "moespec.moe.step.unique_experts", Kind.HISTOGRAM, "{expert}",
    "Distinct routed experts one verify pass touched in one MoE layer.", None, (*STEP_METRIC_KEYS, MOE_LAYER))
STEP_DECODE_STEP_EQUIVALENTS = MetricSpec(
    "moespec.cost.step.decode_step_equivalents", Kind.HISTOGRAM, "1",
    "Verify pass wall time in plain decode steps.", DECODE_STEP_EQUIVALENT_BUCKETS, STEP_METRIC_KEYS)
STEP_SECONDS = MetricSpec(
    "moespec.cost.step.duration", Kind.HISTOGRAM, "s",
    "Draft plus verify wall time of one step (sum / committed tokens = seconds per committed token).",
    STEP_SECONDS_BUCKETS, STEP_METRIC_KEYS)
STEP_DRAFTED_TOKENS = MetricSpec(
    "moespec.spec.step.drafted_tokens", Kind.HISTOGRAM, "{token}",
    "Drafts one verify step verified (the length an adaptive controller chose; at most the policy's).",
    None, (*STEP_METRIC_KEYS, SPEC_CELL))
RULE_CALIBRATION_ERROR = MetricSpec(
    "moespec.spec.rule.calibration_error", Kind.HISTOGRAM, "1",
    "Per request under the moespec controller: |expected - observed accepted drafts| / drafts verified.",
    (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0), STEP_METRIC_KEYS)
DRAFTED_TOKENS = MetricSpec(
    "moespec.spec.drafted_tokens", Kind.COUNTER, "{token}",
    "Draft tokens proposed (accepted / drafted = acceptance rate).", None, STEP_METRIC_KEYS)
COMMITTED_TOKENS = MetricSpec(
    "moespec.spec.committed_tokens", Kind.COUNTER, "{token}",
    "Tokens committed by verify steps (accepted drafts plus the target's own token).", None, STEP_METRIC_KEYS)
STEP_EP_RANKS_TOUCHED = MetricSpec(
    "moespec.moe.step.ep_ranks_touched", Kind.HISTOGRAM, "{rank}",
    "Expert-parallel ranks one verify pass's routed pairs run on, in one MoE layer (estimate, --ep-size).",
    None, (*STEP_METRIC_KEYS, MOE_LAYER))
EP_DISPATCH_BYTES = MetricSpec(
    "moespec.moe.ep_dispatch_bytes", Kind.COUNTER, "By",
    "Bytes of token-expert pairs dispatched off their home rank (estimate, --ep-size; / committed tokens "
    "= all-to-all bytes per token).", None, STEP_METRIC_KEYS)
BATCH_EP_RANKS_TOUCHED = MetricSpec(
    "moespec.moe.batch.ep_ranks_touched", Kind.HISTOGRAM, "{rank}",
    "Expert-parallel ranks one batched verify pass (every request in it) runs routed pairs on, in one MoE "
    "layer (estimate, --ep-size).", None, (MOE_LAYER,))
BATCH_EP_MAX_RANK_EXPERTS = MetricSpec(
    "moespec.moe.batch.ep_max_rank_experts", Kind.HISTOGRAM, "{expert}",
    "Most distinct experts one expert-parallel rank runs for one batched verify pass, in one MoE layer: the "
    "straggler (estimate, --ep-size).", None, (MOE_LAYER,))
BATCH_UNIQUE_EXPERTS = MetricSpec(
    "moespec.moe.batch.unique_experts", Kind.HISTOGRAM, "{expert}",
    "Distinct routed experts one batched verify pass (every request in it) touched in one MoE layer.",
    None, (MOE_LAYER,))
BATCH_SIZE_METRIC = MetricSpec(
    "moespec.batch.size", Kind.HISTOGRAM, "{request}", "Requests one batched verify pass served.",
    (1, 2, 4, 8, 16, 32, 64, 128))
DROPPED_SPANS = MetricSpec(
    "moespec.telemetry.dropped_spans", Kind.COUNTER, "{span}",
    "Spans lost because the export queue was full or the exporter failed.")

# ------------------------------------------------- the tuner's own metrics (moespec tune --continuous)
TUNER_POLICY = "moespec.tuner.policy"  # human label of a policy, e.g. "ngram k=4"
TUNER_EPOCH = "moespec.tuner.epoch"  # how many times the search re-opened on a workload shift
TUNER_STUDY = "moespec.tuner.study"
TUNER_DECISION = "moespec.tuner.decision"  # initial | promote | reopen | keep
TUNER_INCUMBENT = MetricSpec(
    "moespec.tuner.incumbent", Kind.GAUGE, "s",
    "The continuous tuner's incumbent policy (one series, labelled by the policy): its seconds per committed "
    "token on the study's scale.", None, (SPEC_POLICY_ID, TUNER_POLICY, TUNER_EPOCH, TUNER_STUDY))
TUNER_DECISIONS = MetricSpec(
    "moespec.tuner.decisions", Kind.COUNTER, "{decision}",
    "The continuous tuner's decisions: promotions, re-opened searches, challenges that kept the incumbent.",
    None, (TUNER_DECISION, TUNER_STUDY))
TUNER_METRICS = (TUNER_INCUMBENT, TUNER_DECISIONS)
# The tuner's span intake (tuner/span_admission.py): request spans refused before they reach a trial window.
TUNER_DROP_REASON = "moespec.tuner.drop_reason"  # foreign_instance | non_finite_seconds | negative_seconds | ...
TUNER_SPANS_DROPPED = MetricSpec(
    "moespec.tuner.spans_dropped", Kind.COUNTER, "{span}",
    "Request spans the tuner refused: from a replica it does not measure, or carrying impossible aggregates.",
    None, (TUNER_DROP_REASON, TUNER_STUDY))

METRICS = (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, STEP_ACCEPTED_TOKENS, STEP_UNIQUE_EXPERTS,
           STEP_DECODE_STEP_EQUIVALENTS, STEP_SECONDS, STEP_DRAFTED_TOKENS, DRAFTED_TOKENS, COMMITTED_TOKENS,
           BATCH_UNIQUE_EXPERTS, BATCH_SIZE_METRIC, DROPPED_SPANS)
# Emitted only for requests under the moespec controller (its predictions are what it measures).
RULE_METRICS = (RULE_CALIBRATION_ERROR,)
# Emitted only when the server estimates an expert-parallel view (`moespec serve --ep-size`).
EP_METRICS = (STEP_EP_RANKS_TOUCHED, EP_DISPATCH_BYTES, BATCH_EP_RANKS_TOUCHED, BATCH_EP_MAX_RANK_EXPERTS)
ALL_METRICS = METRICS + EP_METRICS + RULE_METRICS


# ------------------------------------------------------ Prometheus translation
# OpenTelemetry -> Prometheus compatibility rules, as both the Python exporter and the Collector's
# `prometheus` exporter apply them: non [a-zA-Z0-9_] -> '_', annotation units ({token}) dropped,
# known units spelled out as a suffix, counters end in _total, histograms add _bucket/_sum/_count.
_PROMETHEUS_UNITS = MappingProxyType({"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": ""})


def prometheus_label(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def prometheus_name(spec: MetricSpec) -> str:
    """The family name (histograms: before _bucket/_sum/_count; counters: with _total)."""
    name = prometheus_label(spec.name)
    unit = "" if spec.unit.startswith("{") else _PROMETHEUS_UNITS.get(spec.unit, spec.unit)
    if unit and not name.endswith("_" + unit):
        name += "_" + unit
    return name + "_total" if spec.kind is Kind.COUNTER else name


def prometheus_series(spec: MetricSpec) -> tuple[str, ...]:
    """Every series name a scrape shows for this metric."""
    base = prometheus_name(spec)
    if spec.kind is Kind.HISTOGRAM:
        return (base + "_bucket", base + "_sum", base + "_count")
    return (base,)
