"""The plugin's per-pass records of one request -> its Windows (attribution.Window), with acceptance.

The records come keyed by request id and in pass order (stats_channel.py), each with the window's
tokens and positions, its per-layer unions measured in SGLang's scheduler and, when asked for, the
routed slot ids. What SGLang does not send per pass is acceptance; it follows from the request's
final tokens exactly as for the recorder (attribution.leading_matches: a rejected draft never equals
the token the target put there), and NGRAM filler drafts are told apart the same way.
"""

from __future__ import annotations

import torch

from service.sglang_backend.attribution import RequestTokens, Window, leading_matches, padding
from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.records import to_logical
from service.sglang_backend.stats_channel import RequestPass
from service.types import BatchPassRecord


def windows_from_tap(records: list[RequestPass], request: RequestTokens, target: MoeGeometry,
                     physical_to_logical: torch.Tensor | None = None) -> list[Window]:
    seq = request.tokens
    moe = list(target.moe_layers)
    out = []
    for record in records:
        p, span = record.stats, record.stats.window(record.index)
        ids, positions = tuple(int(t) for t in p.input_ids[span]), tuple(int(t) for t in p.positions[span])
        start = positions[0]
        accepted = leading_matches(ids, positions, seq)
        committed = min(accepted + 1, len(seq) - 1 - start)
        accepted = min(accepted, committed)
        physical = None if p.topk is None else torch.from_numpy(p.topk[:, span].astype("int32"))  # [L, w, 8]
        out.append(Window(
            pass_index=record.pass_number, mode=p.mode, start=start, input_ids=ids, positions=positions,
            topk_ids=None if physical is None else to_logical(physical, physical_to_logical),
            physical_ids=physical, physical_to_logical=physical_to_logical,
            accepted=accepted, committed=committed, padding=padding(ids, positions, accepted),
            unique=tuple(int(p.unions[record.index, layer]) for layer in moe),
            overlap={"pairwise_overlap_mean": tuple(float(p.pair_mean[record.index, layer]) for layer in moe),
                     "pairwise_overlap_min": tuple(int(p.pair_min[record.index, layer]) for layer in moe)},
            batch=batch_record(record, target),
        ))
    return out


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
