"""Span attributes from the service's dataclasses, and verify-step spans built after the fact.

The engine does not touch telemetry while it runs, so a verify span is made from its StepRecord once
the request is over. StepRecords carry durations, not timestamps: steps are laid back to back so
that the last one ends when the request finished (each step = its draft phase, then its verify
pass, and the span covers the verify pass). Durations are exact; placement is approximate by the
untimed bookkeeping between steps (tens of microseconds per step).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from otel import attributes as a
from service.types import DraftPolicy, GenerationRequest, GenerationResult, ModelInfo, SpecStats, StepRecord


def request_attributes(info: ModelInfo, request: GenerationRequest, policy: DraftPolicy) -> dict:
    """Known when the request starts (also set on a request that then fails)."""
    return {
        a.GEN_AI_OPERATION_NAME: a.GEN_AI_OPERATION,
        a.GEN_AI_PROVIDER_NAME: a.GEN_AI_PROVIDER,
        a.GEN_AI_REQUEST_MODEL: info.model_name,
        a.GEN_AI_REQUEST_TEMPERATURE: float(request.sampling.temperature),
        a.GEN_AI_REQUEST_MAX_TOKENS: int(request.max_new_tokens),
        a.SPEC_POLICY_ID: policy.policy_id,
        a.SPEC_DRAFTER: policy.drafter.value,
        a.SPEC_DRAFT_LENGTH: policy.draft_length,
        a.SPEC_DRAFT_TEMPERATURE: float(policy.draft_temperature),
        a.SPEC_CONTROLLER: policy.controller.value,
        **({a.SPEC_TREE_WIDTH: policy.tree_width} if policy.tree_width > 1 else {}),
    }


def result_attributes(result: GenerationResult) -> dict:
    """The exact per-request aggregates: SpecStats as the engine computed it, unsampled."""
    spec: SpecStats = result.spec
    batch = {a.MOE_BATCH_UNIQUE_EXPERTS_MEAN: tuple(float(x) for x in spec.batch_unique_experts_mean)
             } if spec.batch_unique_experts_mean else {}
    return {
        a.GEN_AI_USAGE_INPUT_TOKENS: result.prompt_tokens,
        a.GEN_AI_USAGE_OUTPUT_TOKENS: result.completion_tokens,
        a.GEN_AI_RESPONSE_FINISH_REASONS: (result.finish_reason.value,),
        a.SPEC_VERIFY_STEPS: spec.verify_steps,
        a.SPEC_DRAFTED_TOKENS: spec.drafted_tokens,
        a.SPEC_ACCEPTED_TOKENS: spec.accepted_tokens,
        a.SPEC_COMMITTED_TOKENS: spec.committed_tokens,
        a.SPEC_EMPTY_DRAFTS: spec.empty_drafts,
        a.MOE_UNIQUE_EXPERTS_MEAN: tuple(float(x) for x in spec.unique_experts_mean),
        a.MOE_UNIQUE_EXPERTS_MAX: tuple(int(x) for x in spec.unique_experts_max),
        a.COST_DRAFT_SECONDS: float(spec.draft_seconds),
        a.COST_VERIFY_SECONDS: float(spec.verify_seconds),
        **ep_request_attributes(result.steps),
        **batch,
        **({a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN: tuple(float(x) for x in spec.branch_unique_experts_mean)}
           if spec.branch_unique_experts_mean else {}),
    }


def ep_request_attributes(steps: Sequence[StepRecord]) -> dict:
    """Exact EP aggregates over the request's passes; empty when the server estimates no EP view."""
    views = [s for s in steps if s.ep_ranks_touched is not None]
    if not views:
        return {}
    layers = range(len(views[0].ep_ranks_touched))
    return {
        a.MOE_EP_RANKS_TOUCHED_MEAN: tuple(sum(s.ep_ranks_touched[i] for s in views) / len(views) for i in layers),
        a.MOE_EP_MAX_RANK_EXPERTS_MAX: tuple(max(s.ep_max_rank_experts[i] for s in views) for i in layers),
        a.MOE_EP_DISPATCH_BYTES: sum(s.ep_dispatch_bytes for s in views),
    }


def verify_attributes(step: StepRecord) -> dict:
    return {
        a.SPEC_DRAFTER: step.drafter.value,
        a.SPEC_DRAFT_LENGTH: step.draft_length,
        a.SPEC_CONTROLLER: step.controller.value,
        a.SPEC_DRAFTED_TOKENS: step.drafted,
        a.SPEC_ACCEPTED_TOKENS: step.accepted,
        a.SPEC_COMMITTED_TOKENS: step.committed,
        a.MOE_UNIQUE_EXPERTS: tuple(int(x) for x in step.unique_experts),
        a.MOE_UNIQUE_EXPERTS_BOUND: step.unique_experts_bound,
        a.MOE_SHARED_EXPERTS: step.shared_experts,
        a.MOE_WIDEST_LAYER: step.widest_layer,
        a.COST_VERIFY_SECONDS: float(step.verify_seconds),
        a.COST_DECODE_STEP_EQUIVALENTS: float(step.decode_step_equivalents),
        **({a.SPEC_CELL: step.cell} if step.cell else {}),
        **tree_attributes(step),
        **({} if not step.pairwise_overlap_mean else {
            a.MOE_PAIRWISE_OVERLAP_MEAN: tuple(float(x) for x in step.pairwise_overlap_mean),
            a.MOE_PAIRWISE_OVERLAP_MIN: tuple(int(x) for x in step.pairwise_overlap_min),
        }),
        **({} if step.ep_ranks_touched is None else {
            a.MOE_EP_RANKS_TOUCHED: tuple(int(x) for x in step.ep_ranks_touched),
            a.MOE_EP_MAX_RANK_EXPERTS: tuple(int(x) for x in step.ep_max_rank_experts),
            a.MOE_EP_DISPATCH_BYTES: int(step.ep_dispatch_bytes),
        }),
    }


def tree_attributes(step: StepRecord) -> dict:
    """A tree step's shape and per-branch unions; nothing for a chain step (its one branch is the window)."""
    if not step.is_tree:
        return {}
    return {
        a.SPEC_TREE_WIDTH: step.tree_width,
        a.SPEC_TREE_DEPTH: step.tree_depth,
        a.SPEC_TREE_BRANCHES: step.branches,
        a.MOE_BRANCH_UNIQUE_EXPERTS_MEAN: step.branch_unique_mean,
        a.MOE_BRANCH_UNIQUE_EXPERTS_MAX: tuple(int(x) for x in step.branch_unique_max),
    }


def emit_verify_spans(tracer: Tracer, parent: Span, steps: Sequence[StepRecord], end_ns: int, ratio: float,
                      rng: random.Random) -> int:
    """Children of `parent` for a `ratio` share of the steps (Bernoulli per step) -> spans emitted."""
    if ratio <= 0 or not steps or not parent.is_recording():
        return 0
    context = trace.set_span_in_context(parent)
    floor_ns = getattr(parent, "start_time", None) or 0  # never start before the request span
    emitted = 0
    step_end = end_ns
    for step in reversed(steps):  # latest first: each step ends where the next one began
        verify_start = max(floor_ns, step_end - int(step.verify_seconds * 1e9))
        if ratio >= 1 or rng.random() < ratio:
            span = tracer.start_span(a.VERIFY_SPAN_NAME, context=context, kind=SpanKind.INTERNAL,
                                     attributes=verify_attributes(step), start_time=verify_start)
            span.end(end_time=step_end)
            emitted += 1
        step_end = max(floor_ns, verify_start - int(step.draft_seconds * 1e9))
    return emitted
