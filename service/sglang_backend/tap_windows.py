"""The plugin's per-pass records of one request -> its Windows (attribution.Window), with acceptance.

The records come keyed by request id and in pass order (stats_channel.py), each with the window's
tokens, positions and draft tree, its per-layer unions measured in SGLang's scheduler and, when asked
for, the routed slot ids. What SGLang does not send per pass is acceptance; it follows from the
request's final tokens and the tree (draft_tree.accepted_path), and NGRAM filler drafts are the filler
nodes off that path (attribution.padding).
"""

from __future__ import annotations

import logging

import torch

from service.sglang_backend.attribution import RequestTokens, Window, padding
from service.sglang_backend.draft_tree import accepted_path, chain_parents, parents_from_links
from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.records import to_logical
from service.sglang_backend.stats_channel import RequestPass
from service.types import BatchPassRecord

log = logging.getLogger(__name__)


def windows_from_tap(records: list[RequestPass], request: RequestTokens, target: MoeGeometry,
                     physical_to_logical: torch.Tensor | None = None, *, ngram: bool = True) -> list[Window]:
    """ngram: the windows may hold NGRAM filler (a model drafter's tree has siblings at one position
    too, and any token, so only NGRAM windows are searched for filler)."""
    seq = request.tokens
    moe = list(target.moe_layers)
    out = []
    for record in records:
        p, span = record.stats, record.stats.window(record.index)
        ids, positions = tuple(int(t) for t in p.input_ids[span]), tuple(int(t) for t in p.positions[span])
        start = positions[0]
        parents = window_parents(p, span)
        path = accepted_path(ids, parents, start, seq)
        committed = min(len(path) + 1, len(seq) - 1 - start)
        accepted = min(len(path), committed)
        physical = None if p.topk is None else torch.from_numpy(p.topk[:, span].astype("int32"))  # [L, w, 8]
        out.append(Window(
            pass_index=record.pass_number, mode=p.mode, start=start, input_ids=ids, positions=positions,
            topk_ids=None if physical is None else to_logical(physical, physical_to_logical),
            physical_ids=physical, physical_to_logical=physical_to_logical,
            accepted=accepted, committed=committed,
            padding=padding(ids, positions, set(path[:accepted])) if ngram else 0,
            unique=tuple(int(p.unions[record.index, layer]) for layer in moe),
            overlap={"pairwise_overlap_mean": tuple(float(p.pair_mean[record.index, layer]) for layer in moe),
                     "pairwise_overlap_min": tuple(int(p.pair_min[record.index, layer]) for layer in moe)},
            batch=batch_record(record, target),
            **({} if p.next_token is None else _linked_tree(p, record.index, parents, path[:accepted], moe)),
        ))
    return out


def _linked_tree(p, index: int, parents: tuple[int, ...], accepted_nodes: tuple[int, ...], moe: list[int]) -> dict:
    """The Window fields of a window the pass linked as a tree (path unions: EAGLE trees only)."""
    path_unique = () if p.path_unions is None else tuple(tuple(int(u) for u in node[moe])
                                                         for node in p.path_unions[index])
    return {"parents": parents, "accepted_nodes": accepted_nodes, "path_unique": path_unique}


def window_parents(p, span: slice) -> tuple[int, ...]:
    """The window's tree (a chain where the pass carried no links, or links that are not a tree)."""
    width = span.stop - span.start
    if p.next_token is None:
        return chain_parents(width)
    try:
        return parents_from_links(p.next_token[span].tolist(), p.next_sibling[span].tolist())
    except ValueError as e:
        log.warning("moespec: pass %d: %s; its windows read as chains", p.pass_id, e)
        return chain_parents(width)


def batch_record(record: RequestPass, target: MoeGeometry) -> BatchPassRecord:
    """The pass's own record (every request of the pass builds an equal one; the telemetry joins them
    by pass_id)."""
    p = record.stats
    positions = p.batch_size * p.width
    return BatchPassRecord(
        pass_id=record.pass_number, batch_size=p.batch_size, positions=positions,
        windows=(p.width,) * p.batch_size,
        unique_experts=tuple(int(p.batch_union[layer]) for layer in target.moe_layers),
        unique_experts_bound=min(target.num_experts, positions * target.top_k),
        draft_seconds=0.0, verify_seconds=(p.end_ns - p.start_ns) / 1e9, start_time_ns=p.start_ns,
    )
