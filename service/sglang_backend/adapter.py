"""Recorder passes + each request's tokens and meta_info -> StepRecords and SpecStats per request.

The one entry point the backend (and the tests) use; the pieces live in records.py (file format),
attribution.py (which tokens of a pass are whose, accepted drafts), meta_info.py and steps.py.
No SGLang import, no GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from service.sglang_backend.attribution import RequestTokens, attribute
from service.sglang_backend.ep import EPConfig
from service.sglang_backend.meta_info import SpecMeta
from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.policy import verify_width
from service.sglang_backend.records import ForwardPass
from service.sglang_backend.steps import expected_steps, spec_stats, steps_from_meta, steps_from_windows
from service.types import DraftPolicy, SpecStats, StepRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedRequest:
    """What the engine returned for one request, plus the wall times the backend measured."""

    tokens: RequestTokens
    meta_info: dict
    decode_seconds: float  # wall time after the first output token


@dataclass(frozen=True)
class AdaptedRequest:
    steps: tuple[StepRecord, ...]
    spec: SpecStats
    from_records: bool  # False: counts from meta_info only (no per-layer experts)


def adapt(
    passes: list[ForwardPass],
    requests: list[FinishedRequest],
    policy: DraftPolicy,
    target: MoeGeometry,
    *,
    decode_step_seconds: float,
    capture_topk: bool = False,
    ep: EPConfig | None = None,
) -> list[AdaptedRequest]:
    """`policy` is the effective one the passes ran under (see policy.effective_policy)."""
    speculative = policy.draft_length > 0
    windows = attribute(
        passes,
        [r.tokens for r in requests],
        speculative=speculative,
        verify_width=verify_width(policy),
        moe_layers=target.moe_layers,
    )
    out = []
    for request, found in zip(requests, windows, strict=True):
        meta = SpecMeta.from_meta_info(request.meta_info) if speculative else None
        completion = len(request.tokens.output_ids)
        expected = expected_steps(meta, completion)
        complete = len(found) == expected
        if complete:
            steps = steps_from_windows(found, policy, target, decode_seconds=request.decode_seconds,
                                       decode_step_seconds=decode_step_seconds, capture_topk=capture_topk, ep=ep)
        else:
            if passes:
                log.warning("found %d of %d recorded steps of a request; reporting meta_info counts only",
                            len(found), expected)
            steps = steps_from_meta(meta, completion, policy, target, decode_seconds=request.decode_seconds,
                                    decode_step_seconds=decode_step_seconds)
        out.append(AdaptedRequest(tuple(steps), spec_stats(steps, policy, target), complete))
    return out
