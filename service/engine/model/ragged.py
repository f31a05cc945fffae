"""Where the tokens of one ragged pass go and where their keys and values live.

A pass runs the windows of several sequences back to back (continuous batching): `RaggedBatch`
says which cache slot and positions each token takes, `KVCache` is the static cache those keys and
values are written to. Slots of rejected draft tokens are never rolled back: the next window simply
overwrites them. Kept apart from the layers because the scheduler, the drafters and the draft head
build batches and caches without running a layer themselves.

Shape legend: N tokens of a pass, B sequences in it, w' its longest window, L layers, K kv heads,
D head dim, S cache length, S' keys a pass attends to.
"""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass

import torch

from service.engine.model.config import ModelConfig


@dataclass(frozen=True)
class RaggedBatch:
    """Where the N tokens of one pass go: B sequences, sequence b a window of lengths[b] tokens at
    positions starts[b].. in cache slot slots[b], concatenated in that order.

    The fused attention kernel needs only `positions`, `token_slot` and `tree` (built with the batch: a step
    builds one per pass). Eager (padded) attention also needs `row`, `col` and `mask`, made on first
    use: queries are laid out [B, w'] (w' the longest window) and each sequence sees its own slot's
    keys up to S' = max(starts + lengths); `mask` [B, 1, w', S'] keeps row i of sequence b to keys <=
    starts[b] + i (its prefix and its window up to itself). Padding rows see key 0 only through that
    rule, so they never produce NaN; their outputs are dropped.
    """

    slots: torch.Tensor  # [B] cache slot of each sequence
    starts: tuple[int, ...]  # [B] position of each window's first token
    lengths: tuple[int, ...]  # [B] tokens in each window
    positions: torch.Tensor  # [N] absolute position of each token
    token_slot: torch.Tensor  # [N] cache slot of each token
    width: int  # w': the longest window
    span: int  # S': keys any sequence attends to
    slot_range: tuple[int, int]  # the lowest and highest cache slot (AttentionPass's bounds check)
    tokens: torch.Tensor | None = None  # [N] the pass's token ids, where the builder was given them
    # The draft trees' paths (kernels/attention.py, `encode_paths`: each node attends the prefix and its
    # path) where some token is a tree node; None: every window is a chain. Fused attention only.
    tree: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.starts)

    @property
    def position_range(self) -> tuple[int, int]:
        """The lowest and highest position of the pass's tokens."""
        return min(self.starts), self.span - 1

    @functools.cached_property
    def row(self) -> torch.Tensor:
        """[N] sequence index b of each token."""
        return torch.repeat_interleave(torch.arange(self.size), torch.tensor(self.lengths))

    @functools.cached_property
    def col(self) -> torch.Tensor:
        """[N] index of each token inside its window."""
        return torch.cat([torch.arange(n) for n in self.lengths])

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, w', S'] (None: one single-token window, which sees everything)."""
        if self.size == 1 and self.width == 1:
            return None
        # [B, w']: the last key each row sees
        visible = torch.tensor(self.starts)[:, None] + torch.arange(self.width)[None, :]
        return (torch.arange(self.span)[None, None, :] <= visible[:, :, None]).unsqueeze(1)

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int],
              tokens: list[int] | None = None, trees: list[list[int] | None] | None = None,
              paths: list[list[int]] | None = None) -> RaggedBatch:
        """tokens: the pass's N token ids, to carry as a tensor (`tokens`), built with the rest.
        Draft trees, either way: trees, per window None (a chain) or [lengths[b]] each token's parent by
        index in the window (-1 for the first token, a parent before its child: a verify pass over whole
        trees); or paths, per token the cache rows of its path, its window's first token first and its
        own position last (a pass over some nodes whose ancestors are in the cache already)."""
        if not slots or len(slots) != len(starts) or len(slots) != len(lengths) or min(lengths) < 1:
            raise ValueError(f"need one or more windows of >= 1 token, got {lengths}")
        # Plain lists, one tensor at the end, cut into views: every step builds this, and a small
        # torch op costs more than the Python here.
        if len(slots) == 1:  # a request alone (every single-stream step): its positions are one range
            positions, token_slot = list(range(starts[0], starts[0] + lengths[0])), [slots[0]] * lengths[0]
            span = starts[0] + lengths[0]
        else:
            positions = [start + i for start, n in zip(starts, lengths, strict=True) for i in range(n)]
            token_slot = [slot for slot, n in zip(slots, lengths, strict=True) for _ in range(n)]
            span = max(start + n for start, n in zip(starts, lengths, strict=True))
        N = len(positions)
        if tokens is not None and len(tokens) != N:
            raise ValueError(f"{len(tokens)} token ids for windows of {N} tokens")
        # (from an int64 array: torch.tensor parses a list element by element, ~4x the time here)
        packed = torch.frombuffer(array.array("q", positions + token_slot + list(slots) + (tokens or [])),
                                  dtype=torch.int64)
        return cls(slots=packed[2 * N:2 * N + len(slots)], starts=tuple(starts), lengths=tuple(lengths),
                   positions=packed[:N], token_slot=packed[N:2 * N], width=max(lengths), span=span,
                   slot_range=(min(slots), max(slots)), tokens=None if tokens is None else packed[-N:],
                   tree=(encode_paths(paths, positions) if paths is not None
                         else encode_paths(_window_paths(starts, lengths, trees), positions)
                         if trees and any(t is not None for t in trees) else None))



def _window_paths(starts: list[int], lengths: list[int], trees: list[list[int] | None]) -> list[list[int]]:
    """Each token's path of cache rows, from windows given by their parents (None: a chain)."""
    if len(trees) != len(lengths):
        raise ValueError(f"{len(trees)} trees for {len(lengths)} windows")
    paths = []
    for start, n, tree in zip(starts, lengths, trees, strict=True):
        local = list(range(-1, n - 1)) if tree is None else tree
        if len(local) != n or local[0] != -1 or any(not -1 < p < i for i, p in enumerate(local) if i):
            raise ValueError(f"a window's tree must give {n} parents, -1 first, each before its child: got {local}")
        window: list[list[int]] = []
        for i, parent in enumerate(local):
            window.append([start] if parent < 0 else [*window[parent], start + i])
        paths += window
    return paths


def encode_paths(paths: list[list[int]], positions: list[int]) -> torch.Tensor:
    """The fused attention's `tree` argument: N offsets, then per token [d, b, r1, .., rd], its path's
    rows from its window's first token b to its own position rd (d = 0: the first token itself)."""
    if len(paths) != len(positions):
        raise ValueError(f"{len(paths)} paths for {len(positions)} tokens")
    offsets, records = [], []
    for path, position in zip(paths, positions, strict=True):
        if not path or path[-1] != position or min(path) < 0 or path[0] != min(path):
            raise ValueError(f"a token's path must run from its window's first row to its own position "
                             f"{position}: got {path}")
        offsets.append(len(paths) + len(records))
        records += [len(path) - 1, *path]
    return torch.tensor(offsets + records, dtype=torch.int64)


class KVCache:
    """Static cache [L, slots, K, S, D]: one slot per sequence in flight; positions are written
    explicitly and never rolled back (a rejected draft's slot is overwritten by the next window)."""

    def __init__(self, cfg: ModelConfig, max_len: int, slots: int = 1, dtype: torch.dtype = torch.float32):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.slots = slots

    def write_ragged(self, layer: int, batch: RaggedBatch, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, K, D] at each token's (slot, position) -> the batch's keys, values [B, K, S', D]."""
        ck, cv = self.k[layer], self.v[layer]  # [slots, K, S, D]
        if batch.size == 1:  # one window: contiguous positions, written and read through views
            slot, start = int(batch.slots[0]), batch.starts[0]
            ck[slot, :, start:batch.span] = k.transpose(0, 1)  # [K, w, D]
            cv[slot, :, start:batch.span] = v.transpose(0, 1)
            return ck[slot:slot + 1, :, :batch.span], cv[slot:slot + 1, :, :batch.span]
        ck[batch.token_slot, :, batch.positions] = k
        cv[batch.token_slot, :, batch.positions] = v
        # index_select on the first dim is a plain row copy (advanced indexing here is several times slower)
        return ck[:, :, :batch.span].index_select(0, batch.slots), cv[:, :, :batch.span].index_select(0, batch.slots)
