"""Split recorded forward passes per request, and find each step's accepted drafts.

The 0.5.23 recorder stores no request ids (the `rids` line is commented out in
`_DetailSinglePassGatherer.on_forward_pass_start`), so a pass is split by what it does store:
- TARGET_VERIFY: every request contributes exactly `verify_width` = speculative_num_draft_tokens
  consecutive tokens (EAGLE/STANDALONE chains and NGRAM trees alike), in batch order. For a chain
  (topk 1) they are [the last committed token, draft 1..k] at positions [s, s+1, .., s+k].
- DECODE (speculation off): one token per request, the last committed token at its position.
- MIXED: segments by extend_seq_lens; only length-1 segments are decode steps.
A segment belongs to the request whose next step may start at that position with that token: a
request's first step starts at len(prompt) with its first output token (the prefill produced it),
and a step that accepted a drafts moves the start by a + 1. The recorder stores no tree links, so a
window's acceptance is bracketed while it is open: at least the leading drafts of a chain prefix
that carry the committed tokens (draft_tree.py: a rejected draft never carries the token the target
put there), at most the depth to which every position holds some node with the committed token. The
request's next window settles it exactly (its start is this start + a + 1); its last window commits
what is left of the output (all drafts when the bracket reaches that far; a cousin carrying the same
token on another branch could fool that one case).

NGRAM padding: SGLang's NGRAM always verifies k + 1 tokens. When its trie matches j < k tokens
it fills the window with filler drafts (token 0) hung off the root as siblings, e.g. no match:
input_ids [t, 0, 0, 0] at positions [s, s+1, s+1, s+1]; j = 2: [t, a, b, 0, 0] at
[s, s+1, s+2, s+1, s+1]. The filler runs through every layer (real cost: it stays in the window's
unions) but was not drafted: a draft is padding when it is the filler token, shares its position
with another node of the window, and was not accepted. (A real draft of token 0 next to padding
would be counted as padding too; the target accepting a filler makes it a real, accepted draft.)

Passes of the draft model (dense: no routed ids in the MoE layers) and DECODE passes while
speculating (those are draft steps) are skipped. One request appears at most once per pass;
identical concurrent requests are told apart by that rule and batch order, which is harmless:
identical prefixes route identically.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from service.sglang_backend.records import ForwardMode, ForwardPass
from service.types import BatchPassRecord

NGRAM_FILLER = 0  # the token SGLang's NGRAM pads short matches with (0.5.23, observed on the real thing)


@dataclass(frozen=True)
class RequestTokens:
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class Window:
    """One request's slice of one verify (or plain decode) pass."""

    pass_index: int
    mode: int
    start: int  # position of the window's first token (the last committed token)
    input_ids: tuple[int, ...]  # [w]
    positions: tuple[int, ...]  # [w]
    topk_ids: torch.Tensor | None  # [L, w, 8] logical ids, -1 = none (None: not captured)
    physical_ids: torch.Tensor | None  # [L, w, 8] physical slot ids as recorded, -1 = none
    physical_to_logical: torch.Tensor | None  # [L, S] the map SGLang ran the pass with (None: identity)
    accepted: int  # drafts the target accepted
    committed: int  # tokens this step added to the output (accepted + 1, less what the end cut)
    padding: int = 0  # NGRAM filler drafts in the window (verified, never drafted)
    unique: tuple[int, ...] | None = None  # [L] distinct routed experts per layer, when measured in SGLang
    overlap: dict | None = None  # the StepRecord's pairwise-overlap fields, when measured in SGLang
    batch: BatchPassRecord | None = None  # the pass this window was verified in (plugin records only)
    # A window the plugin saw linked as a tree (plugin records only): each node's parent (-1 for node 0,
    # the window's first token), the accepted nodes in depth order, and [w][L] the distinct experts over
    # each node's path (node 0 down to it).
    parents: tuple[int, ...] | None = None
    accepted_nodes: tuple[int, ...] = ()
    path_unique: tuple[tuple[int, ...], ...] = ()

    @property
    def width(self) -> int:
        return len(self.input_ids)

    @property
    def drafted(self) -> int:
        return self.width - 1 - self.padding


def segments(p: ForwardPass, verify_width: int) -> list[tuple[int, int]]:
    """(offset, length) of each request's tokens in the pass; [] where it cannot be split."""
    n = p.num_tokens
    if p.mode == ForwardMode.TARGET_VERIFY:
        if verify_width < 1 or n % verify_width:
            return []
        return [(i, verify_width) for i in range(0, n, verify_width)]
    if p.mode == ForwardMode.DECODE:
        return [(i, 1) for i in range(n)]
    if p.mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.SPLIT_PREFILL) and p.extend_seq_lens:
        out, offset = [], 0
        for length in p.extend_seq_lens:
            out.append((offset, length))
            offset += length
        return out if offset == n else []
    return []


def attribute(
    passes: list[ForwardPass],
    requests: list[RequestTokens],
    *,
    speculative: bool,
    verify_width: int,
    moe_layers: tuple[int, ...],
) -> list[list[Window]]:
    """Windows of each request (same order as `requests`), in run order."""
    tokens = [r.tokens for r in requests]
    earliest = [len(r.prompt_ids) for r in requests]  # where each request's next step may start
    latest = list(earliest)
    out: list[list[Window]] = [[] for _ in requests]
    for p in passes:
        if not _is_step_pass(p, speculative) or not p.has_routing(moe_layers):
            continue
        taken: set[int] = set()
        for offset, length in segments(p, verify_width):
            if not speculative and length != 1:
                continue  # a prefill chunk inside a MIXED pass
            ids, positions = p.input_ids[offset:offset + length], p.positions[offset:offset + length]
            start, best, best_accepted = positions[0], None, -1
            for r, seq in enumerate(tokens):
                # The pass must still add a token: the request's last token is never an input.
                if r in taken or not earliest[r] <= start <= latest[r] or start >= len(seq) - 1 or seq[start] != ids[0]:
                    continue
                accepted = leading_matches(ids, positions, seq)
                if accepted > best_accepted:
                    best, best_accepted = r, accepted
            if best is None:
                continue
            if out[best]:
                previous = out[best][-1]
                out[best][-1] = _settled(previous, start - previous.start - 1, tokens[best])
            out[best].append(Window(
                pass_index=p.index, mode=p.mode, start=start, input_ids=ids, positions=positions,
                topk_ids=p.topk_ids[:, offset:offset + length],
                physical_ids=p.physical_ids[:, offset:offset + length],
                physical_to_logical=p.physical_to_logical,
                accepted=best_accepted, committed=best_accepted + 1,  # settled by the next window
            ))
            taken.add(best)
            earliest[best] = start + best_accepted + 1
            latest[best] = start + reach(ids, positions, tokens[best]) + 1
    for r, found in enumerate(out):
        if found:
            last = found[-1]
            left = len(tokens[r]) - 1 - last.start
            found[-1] = _settled(last, min(reach(last.input_ids, last.positions, tokens[r]), left), tokens[r], left)
    return out


def _settled(w: Window, accepted: int, seq: tuple[int, ...], committed: int | None = None) -> Window:
    committed = accepted + 1 if committed is None else committed
    on_path = {j for j in range(1, w.width)
               if 1 <= w.positions[j] - w.start <= accepted and w.input_ids[j] == seq[w.positions[j]]}
    return replace(w, accepted=accepted, committed=committed, padding=padding(w.input_ids, w.positions, on_path))


def _is_step_pass(p: ForwardPass, speculative: bool) -> bool:
    if speculative:
        return p.mode == ForwardMode.TARGET_VERIFY
    return p.mode in (ForwardMode.DECODE, ForwardMode.MIXED)


def leading_matches(input_ids, positions, seq: tuple[int, ...]) -> int:
    """Drafts 1.. of a window that sit on the chain (next position) and equal the committed token there.
    Exact for a chain; for a tree a lower bound (in BFS order a chain prefix is a path)."""
    start = positions[0]
    accepted = 0
    for j in range(1, len(input_ids)):
        pos = start + j
        if positions[j] != pos or pos >= len(seq) or input_ids[j] != seq[pos]:
            break
        accepted += 1
    return accepted


def reach(input_ids, positions, seq: tuple[int, ...]) -> int:
    """Depth to which every position of the window holds some node with the committed token: an upper
    bound on the accepted drafts of any tree with these nodes."""
    start, depth = positions[0], 0
    while start + depth + 1 < len(seq) and any(
            p == start + depth + 1 and t == seq[p] for t, p in zip(input_ids, positions, strict=True)):
        depth += 1
    return depth


def padding(input_ids: tuple[int, ...], positions: tuple[int, ...], accepted_nodes: set[int]) -> int:
    """NGRAM filler drafts of one window: filler token, a shared position, not accepted."""
    shared = {p for p in positions if positions.count(p) > 1}
    return sum(1 for j in range(1, len(input_ids))
               if j not in accepted_nodes and input_ids[j] == NGRAM_FILLER and positions[j] in shared)


def unique_experts(topk_ids: torch.Tensor, moe_layers: tuple[int, ...], num_experts: int) -> tuple[int, ...]:
    """Distinct routed experts per MoE layer over a window ([L, w, 8] -> [len(moe_layers)])."""
    counts = []
    for layer in moe_layers:
        ids = topk_ids[layer].reshape(-1)
        # Ids outside [0, E) are padding (-1) or a fused shared-expert slot: not routed experts.
        counts.append(int(torch.unique(ids[(ids >= 0) & (ids < num_experts)]).numel()))
    return tuple(counts)
