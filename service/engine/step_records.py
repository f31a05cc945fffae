"""The records of one scheduler step: a StepRecord per sequence and a BatchPassRecord for the pass.

A sequence's StepRecord holds its own window's union (the distinct experts its positions picked,
per layer); the pass's BatchPassRecord the union over every position of every window, its bound
and the prompt tokens of the prefill pass just before it, and is attached to each of those
StepRecords. Routed ids go into a record only where it keeps them (captured top-k ids, an
expert-parallel estimate): a batched step builds one record per request, so a record does nothing
its request does not need. `StepRecords` holds what the records depend on (the model's expert counts,
what is counted and kept); apart from the scheduler's loop because this is pure bookkeeping over a
finished pass: it never runs a model or touches a sequence's state.

Shape legend: B windows in a pass, N positions in it, w a window, L layers, m experts per token,
E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.engine.sequence import Sequence
from service.engine.spec.adaptive.controller import StepController, adapts
from service.engine.spec.tree_acceptance import DraftTree
from service.routing import expert_parallel
from service.routing.expert_sets import pairwise_overlap
from service.types import BatchPassRecord, StepRecord, accepted_positions, tree_branches


def unique_experts_per_layer(routed: torch.Tensor, num_experts: int) -> tuple[int, ...]:
    """routed ids [L, w, m] -> distinct experts per layer: mark every expert any position picked."""
    L = routed.shape[0]
    touched = np.zeros((L, num_experts), dtype=bool)
    np.put_along_axis(touched, routed.numpy().reshape(L, -1), True, axis=1)  # [L, E]
    return tuple(touched.sum(-1).tolist())


def unique_experts_per_window(routed: torch.Tensor, lengths: list[int], num_experts: int
                              ) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """routed ids [L, N, m] of B windows back to back -> (each window's distinct experts per layer,
    the whole pass's), in one scatter: `unique_experts_per_layer` of every window and of the pass.
    (numpy: on arrays this small each torch op costs several times more.)"""
    L, N, m = routed.shape
    B = len(lengths)
    window = np.repeat(np.arange(B), lengths)  # [N] window of each position
    flat = (window[None, :, None] * num_experts + routed.numpy()).reshape(L, N * m)  # [L, N*m] into [B*E]
    touched = np.zeros((L, B * num_experts), dtype=bool)
    np.put_along_axis(touched, flat, True, axis=1)
    touched = touched.reshape(L, B, num_experts)
    own = touched.sum(-1).T.tolist()  # [B, L]
    return [tuple(c) for c in own], tuple(touched.any(1).sum(-1).tolist())


@dataclass(frozen=True)
class StepRecords:
    num_experts: int  # E
    top_k: int  # m
    count_routing: bool = True  # count unique experts and overlaps (off only to measure their overhead)
    keep_topk: bool = False  # records keep each window's routed ids (top-k capture, a step recording)
    ep: expert_parallel.Placement | None = None  # estimate each pass's expert-parallel cost on this placement
    ep_token_bytes: int = 0  # bytes one token's hidden state moves to a rank (the EP estimate)

    @property
    def keeps_ids(self) -> bool:
        """Step records need each window's routed ids: captured top-k ids, or an EP estimate."""
        return self.keep_topk or self.ep is not None

    def unions(self, routed: torch.Tensor, lengths: list[int]) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        """Each window's distinct experts per layer and the pass's (zeros when routing is not counted)."""
        if not self.count_routing:
            zeros = (0,) * routed.shape[0]
            return [zeros] * len(lengths), zeros
        E, m = self.num_experts, self.top_k
        if max(lengths) == 1:  # plain decoding: one position picks m distinct experts (top-k), nothing to count
            own = (m,) * routed.shape[0]
            return [own] * len(lengths), own if len(lengths) == 1 else unique_experts_per_layer(routed, E)
        if len(lengths) == 1:  # a request alone: its window is the pass (one scatter, fewer ops)
            unique = unique_experts_per_layer(routed, E)
            return [unique], unique
        return unique_experts_per_window(routed, lengths, E)

    def overlaps(self, routed: torch.Tensor, lengths: list[int]) -> list[dict]:
        """Each window's pairwise overlap per layer (service/routing/expert_sets.py), as StepRecord fields;
        {} each when routing is not counted. All windows of the pass in one matmul: the Gram matrix of
        the pass's positions' expert sets, read within each window."""
        if not self.count_routing:
            return [{}] * len(lengths)
        E, m = self.num_experts, self.top_k
        L = routed.shape[0]
        one = {"pairwise_overlap_mean": (float(m),) * L, "pairwise_overlap_min": (m,) * L}  # a lone position
        if max(lengths) == 1:
            return [one] * len(lengths)
        if len(lengths) == 1:
            mean, low = pairwise_overlap(routed.numpy(), E)
            return [{"pairwise_overlap_mean": mean, "pairwise_overlap_min": low}]
        starts = np.cumsum([0, *lengths[:-1]])
        pair_i, pair_j, segment = [], [], []  # pairs i < j inside each window, window by window
        for start, w in zip(starts, lengths, strict=True):
            i, j = np.triu_indices(w, 1)
            pair_i.append(start + i)
            pair_j.append(start + j)
            segment.append(len(i))
        ids = routed.numpy()
        sets = np.zeros((L, ids.shape[1], E), dtype=np.float32)  # [L, N, E]
        np.put_along_axis(sets, ids, 1.0, axis=2)
        gram = sets @ sets.transpose(0, 2, 1)  # [L, N, N]
        values = gram[:, np.concatenate(pair_i), np.concatenate(pair_j)]  # [L, P]
        bounds = np.cumsum([0, *segment[:-1]])
        has_pairs = np.array(segment) > 0
        sums = np.add.reduceat(values, bounds[has_pairs], axis=1)  # [L, windows with pairs]
        lows = np.minimum.reduceat(values, bounds[has_pairs], axis=1)
        out, k = [], 0
        for count in segment:
            if not count:
                out.append(one)
                continue
            out.append({"pairwise_overlap_mean": tuple(float(x) for x in sums[:, k] / count),
                        "pairwise_overlap_min": tuple(int(x) for x in lows[:, k])})
            k += 1
        return out

    def pass_record(self, pass_id: int, lengths: list[int], routed: torch.Tensor, unique: tuple[int, ...],
                    prefill_tokens: int, start_ns: int, draft_s: float, verify_s: float) -> BatchPassRecord:
        N = sum(lengths)
        return BatchPassRecord(pass_id=pass_id, batch_size=len(lengths), positions=N,
                               windows=tuple(lengths), unique_experts=unique,
                               unique_experts_bound=min(self.num_experts, N * self.top_k),
                               draft_seconds=draft_s, verify_seconds=verify_s, start_time_ns=start_ns,
                               prefill_tokens=prefill_tokens, **self._ep_fields(routed))

    def step_record(self, seq: Sequence, drafted: int, accepted: int, window: list[int],
                    routed: torch.Tensor | None, unique: tuple[int, ...], draft_s: float, verify_s: float,
                    step_unit: float, batch: BatchPassRecord, planned: int, overlap: dict,
                    tree: DraftTree | None = None, on_path: tuple[bool, ...] = ()) -> StepRecord:
        """routed: the window's ids [L, w, m] (None unless `keeps_ids` or the window is a tree); planned:
        the drafts the sequence's controller asked for (recorded where a controller adapts the length);
        overlap: its pairwise-overlap fields (`overlaps`); tree: the window's draft tree, on_path [drafted]
        its nodes on the accepted path (a chain: None, ())."""
        capture = self.keep_topk
        return StepRecord.of_policy(
            seq.step_policy,
            drafted=drafted,
            accepted=accepted,
            committed=accepted + 1,
            accepted_per_position=accepted_positions(drafted, accepted) if tree is None else on_path,
            window=len(window),
            unique_experts=unique,
            shared_experts=1,
            num_experts=self.num_experts,
            top_k=self.top_k,
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            decode_step_equivalents=verify_s / step_unit,
            topk_ids=tuple(tuple(tuple(pos) for pos in layer) for layer in routed.tolist()) if capture else None,
            window_ids=tuple(window) if capture else None,
            batch=batch,
            cell=seq.cell,
            **adaptive_fields(seq.controller, planned, drafted),
            **overlap,
            **self._ep_fields(routed),
            **({} if tree is None else self._tree_fields(tree, routed)),
        )

    def _tree_fields(self, tree: DraftTree, routed: torch.Tensor) -> dict:
        """A tree window's parents and its per-branch unions: each root-to-leaf branch's positions (the
        window's first token, then its nodes) counted per layer, as a chain along it would have been."""
        branches = tree_branches(tree.parents)
        unique = ([unique_experts_per_layer(routed[:, [0, *(1 + i for i in branch)]], self.num_experts)
                   for branch in branches] if self.count_routing else [(0,) * routed.shape[0]] * len(branches))
        return {"tree_parents": tree.parents, "branch_unique": tuple(unique)}

    def _ep_fields(self, routed: torch.Tensor | None) -> dict:
        """The optional expert-parallel fields, estimated only with an EP placement."""
        return {} if self.ep is None else expert_parallel.pass_fields(self.ep, routed, self.ep_token_bytes)


def adaptive_fields(controller: StepController, planned: int, drafted: int) -> dict:
    """What an adaptive controller adds to a step record (nothing for the static policy)."""
    if not adapts(controller):
        return {}
    return {"planned": planned, "predicted_accepted": controller.expected_accepted(drafted)}
