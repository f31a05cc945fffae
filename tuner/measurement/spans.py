"""Span dicts (from otel.receiver) -> RequestSample, for request spans only.

Contract: a request span is one named `text_completion {model}` that carries a policy id; verify-step
spans and anything else yield None. Attribute keys come from `otel.attributes` (one place).
A span missing a required aggregate yields None rather than a wrong number in the objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from otel import attributes as attr
from service.types import Drafter, DraftPolicy
from tuner.loop.space import policy_key
from tuner.measurement.window import RequestSample

REQUEST_SPAN_PREFIX = "text_completion"


def request_sample(span: Mapping) -> RequestSample | None:
    if not str(span.get("name", "")).startswith(REQUEST_SPAN_PREFIX):
        return None
    a = span.get("attributes") or {}
    policy_id = a.get(attr.SPEC_POLICY_ID)
    if not policy_id:
        return None
    try:
        return RequestSample(
            policy_id=str(policy_id),
            verify_steps=int(a[attr.SPEC_VERIFY_STEPS]),
            drafted_tokens=int(a.get(attr.SPEC_DRAFTED_TOKENS, 0)),
            accepted_tokens=int(a.get(attr.SPEC_ACCEPTED_TOKENS, 0)),
            committed_tokens=int(a[attr.SPEC_COMMITTED_TOKENS]),
            unique_experts_mean=tuple(float(x) for x in a.get(attr.MOE_UNIQUE_EXPERTS_MEAN, ())),
            draft_seconds=float(a.get(attr.COST_DRAFT_SECONDS, 0.0)),
            verify_seconds=float(a[attr.COST_VERIFY_SECONDS]),
            output_tokens=int(a.get(attr.GEN_AI_USAGE_OUTPUT_TOKENS, 0)),
            drafter=str(a.get(attr.SPEC_DRAFTER, "")),
            draft_length=int(a.get(attr.SPEC_DRAFT_LENGTH, -1)),
            draft_temperature=float(a.get(attr.SPEC_DRAFT_TEMPERATURE, 1.0)),
            tree_width=int(a.get(attr.SPEC_TREE_WIDTH, 1)),
            ep_dispatch_bytes=int(a.get(attr.MOE_EP_DISPATCH_BYTES, 0)),
            instance_id=str((span.get("resource") or {}).get(attr.RESOURCE_SERVICE_INSTANCE_ID, "")),
        )
    except (KeyError, TypeError, ValueError):
        return None


def ran_policy(sample: RequestSample, policy: DraftPolicy) -> bool:
    """Whether the span's own policy fields agree with `policy` (True when the span omits them).
    Guards a window against stale spans that reuse its id, e.g. from an earlier study of the same
    name on another storage, whose requests ran a different policy. A request span carries the
    drafter, draft length, draft temperature and tree width of the policy's base (not its controller,
    cost weight or table cells), so only those are compared: the rest is taken from `policy`."""
    if sample.draft_length < 0 or not sample.drafter:
        return True
    base = replace(policy, cells=())
    try:
        ran = replace(base, drafter=Drafter(sample.drafter), draft_length=sample.draft_length,
                      draft_temperature=sample.draft_temperature, tree_width=sample.tree_width)
    except ValueError:
        return False
    return policy_key(ran) == policy_key(base)
