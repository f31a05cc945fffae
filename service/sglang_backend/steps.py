"""Attributed windows (+ meta_info) -> moespec StepRecords and SpecStats for one request.

Pure Python on plain data: no SGLang, no GPU. What SGLang does not tell, and how it is filled:
- Per-pass wall time: the recorder stores none, so each step gets an equal share of the request's
  decode time (wall time after the first token) in verify_seconds; draft_seconds is 0 because
  SGLang overlaps drafting and verifying in one scheduler iteration. Sums stay exact, which is
  what the request aggregates and the tuner's objective use.
- The first output token comes from the prefill (an EXTEND pass), not from a step, so
  committed_tokens = completion_tokens - 1 (the embedded engine counts it in its first step).
- When the recorder is off or a request's windows cannot all be found, the steps are rebuilt from
  meta_info's histogram (counts exact, order and experts unknown: unique_experts all 0, no EP view).
- With an EP size (ep.py) every window's step carries the ep_* fields; should SGLang's map not
  split into P ranks (redundant experts), the request's steps go without them and a warning says why.
"""

from __future__ import annotations

import logging

from service.routing import expert_parallel
from service.sglang_backend.attribution import Window, unique_experts
from service.sglang_backend.draft_tree import chain_parents
from service.sglang_backend.ep import EPConfig, window_view
from service.sglang_backend.meta_info import SpecMeta
from service.sglang_backend.model_config import MoeGeometry
from service.types import BatchPassRecord, DraftPolicy, SpecStats, StepRecord, accepted_positions, tree_branches

log = logging.getLogger(__name__)


def steps_from_windows(
    windows: list[Window],
    policy: DraftPolicy,
    target: MoeGeometry,
    *,
    decode_seconds: float,
    decode_step_seconds: float,
    capture_topk: bool = False,
    ep: EPConfig | None = None,
) -> list[StepRecord]:
    share = decode_seconds / len(windows) if windows else 0.0
    views = _ep_views(windows, ep)
    out = []
    for w, view in zip(windows, views, strict=True):
        drafted = w.drafted  # NGRAM filler excluded; the window (and its unions) keeps it
        topk = None
        if capture_topk and w.topk_ids is not None:
            # [L, w, m] over the MoE layers, the recorder's -1 padding columns dropped.
            topk = tuple(tuple(tuple(row[:target.top_k]) for row in w.topk_ids[layer].tolist())
                         for layer in target.moe_layers)
        out.append(_record(policy, target, drafted, w.accepted, w.committed, w.width,
                           w.unique if w.unique is not None else unique_experts(w.topk_ids, target.moe_layers,
                                                                                target.num_experts),
                           share, decode_step_seconds, topk, w.input_ids if topk is not None else None,
                           {**(w.overlap or {}), **({} if view is None else expert_parallel.step_fields(view)),
                            **(tree_fields(w) if policy.tree_width > 1 else {})},
                           w.batch))
    return out


def tree_fields(w: Window) -> dict:
    """A tree window's StepRecord fields (as the embedded engine records its trees): the nodes' parents
    (-1 = the window's first token), on-path flags, and each root-to-leaf branch's union (its leaf's
    path union). {} for a window the plugin did not send as a tree, or whose tree is a chain."""
    if w.parents is None or not w.path_unique or w.parents == chain_parents(w.width):
        return {}
    parents = tuple(p - 1 for p in w.parents[1:])  # window node j is record node j - 1
    on_path = set(w.accepted_nodes)
    return {"tree_parents": parents,
            "accepted_per_position": tuple(j in on_path for j in range(1, w.width)),
            "branch_unique": tuple(w.path_unique[1 + branch[-1]] for branch in tree_branches(parents))}


def _ep_views(windows: list[Window], ep: EPConfig | None) -> list[expert_parallel.PassView | None]:
    if ep is None:
        return [None] * len(windows)
    try:
        return [window_view(w, ep) for w in windows]
    except expert_parallel.PlacementError as e:  # telemetry only: the request itself is fine
        log.warning("no EP view for this request: %s", e)
        return [None] * len(windows)


def steps_from_meta(
    meta: SpecMeta | None,
    completion_tokens: int,
    policy: DraftPolicy,
    target: MoeGeometry,
    *,
    decode_seconds: float,
    decode_step_seconds: float,
) -> list[StepRecord]:
    """Counts-only steps: one per plain decode token, or per verify pass from the histogram."""
    zeros = (0,) * len(target.moe_layers)
    if meta is None:
        accepted = [0] * max(0, completion_tokens - 1)
    else:
        accepted = [a for a, count in enumerate(meta.histogram) for _ in range(count)]
    share = decode_seconds / len(accepted) if accepted else 0.0
    k = policy.draft_length if meta is not None else 0
    return [_record(policy, target, k, a, a + 1, k + 1, zeros, share, decode_step_seconds, None, None, {}, None)
            for a in accepted]


def expected_steps(meta: SpecMeta | None, completion_tokens: int) -> int:
    """Verify passes SGLang counted, or plain decode passes (every token after the prefill's)."""
    return meta.verify_ct if meta is not None else max(0, completion_tokens - 1)


def spec_stats(steps: list[StepRecord], policy: DraftPolicy, target: MoeGeometry) -> SpecStats:
    return SpecStats.from_steps(steps, policy, len(target.moe_layers))


def _record(policy: DraftPolicy, target: MoeGeometry, drafted: int, accepted: int, committed: int, window: int,
            unique: tuple[int, ...], seconds: float, decode_step_seconds: float,
            topk: tuple | None, window_ids: tuple[int, ...] | None, optional: dict,
            batch: BatchPassRecord | None) -> StepRecord:
    """optional: the pairwise-overlap, EP and tree fields, where known (a tree's on-path flags among them)."""
    return StepRecord.of_policy(
        policy,
        drafted=drafted,
        accepted=accepted,
        committed=committed,
        accepted_per_position=optional.pop("accepted_per_position", accepted_positions(drafted, accepted)),
        window=window,
        unique_experts=unique,
        shared_experts=target.shared_experts,
        num_experts=target.num_experts,
        top_k=target.top_k,
        draft_seconds=0.0,
        verify_seconds=seconds,
        decode_step_equivalents=seconds / decode_step_seconds if decode_step_seconds > 0 else 0.0,
        topk_ids=topk,
        window_ids=window_ids,
        batch=batch,
        **optional,
    )
