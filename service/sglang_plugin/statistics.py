"""Per-pass routing statistics on the device: what each request's window touched, per layer.

Plain torch, no SGLang: the tap (tap.py) feeds it. Every operation has a static shape and reads no
value back to the host, so a CUDA graph captured while it runs records it, and a replay fills the
same buffers (`on_routed` is called while SGLang captures its graphs, `begin` and `finish` run
eagerly around each pass). The buffers are sized once, large enough for the largest pass seen first
(SGLang captures its biggest graph first); a later, larger eager pass grows them.

A verify pass of draft trees (EAGLE with topk > 1, NGRAM) also gets each node's *path union*: the
distinct experts over the node's root-to-node path, what a chain along it would have touched; a
branch's union is its leaf's path union. The tree comes as SGLang links it (first child / next
sibling per node) and is resolved on the device with a fixed number of steps (w), no host reads.

Shape legend: L layers (dense ones too; they stay empty), C capacity in tokens, n tokens of the pass,
B requests, w tokens per request (n = B*w), E logical experts (+1 column that swallows padding ids),
m routed ids per token as SGLang hands them (at most RECORD_WIDTH kept when asked to).
"""

from __future__ import annotations

import torch

RECORD_WIDTH = 8  # routed ids kept per token when capturing (SGLang's recorder keeps 8 as well)
MIN_CAPACITY = 256


class PassStatistics:
    def __init__(self, layers: int, experts: int, physical_to_logical: torch.Tensor | None, device: torch.device,
                 capture_topk: bool):
        self.layers, self.experts, self.device, self.capture_topk = layers, experts, device, capture_topk
        # [L, P] physical slot -> logical expert: with EPLB redundancy two slots hold one expert, which
        # a union counts once. None: the identity.
        self._to_logical = None if physical_to_logical is None else physical_to_logical.to(device, torch.int64)
        self.capacity = 0
        self._bits: torch.Tensor | None = None  # [L, C, E+1] uint8: token t routed to expert e in layer l
        self._topk: torch.Tensor | None = None  # [L, C, RECORD_WIDTH] int16 physical ids, -1 = none

    def ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        capacity = max(MIN_CAPACITY, 1 << (tokens - 1).bit_length())
        self._bits = torch.zeros(self.layers, capacity, self.experts + 1, dtype=torch.uint8, device=self.device)
        if self.capture_topk:
            self._topk = torch.full((self.layers, capacity, RECORD_WIDTH), -1, dtype=torch.int16, device=self.device)
        self.capacity = capacity

    def begin(self, tokens: int) -> None:
        """Clear what the pass will write (dense layers and earlier, larger passes leave no trace)."""
        self.ensure_capacity(tokens)
        self._bits[:, :tokens].zero_()
        if self._topk is not None:
            self._topk[:, :tokens].fill_(-1)

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [n, m] physical slot ids of one MoE layer, -1 for padded rows."""
        n, m = topk_ids.shape
        if n > self.capacity or not 0 <= layer < self.layers:
            return
        ids = topk_ids.to(torch.int64)  # [n, m]
        if self._to_logical is not None:
            slots = self._to_logical.shape[1]
            valid = (ids >= 0) & (ids < slots)
            logical = self._to_logical[layer].gather(0, ids.clamp(0, slots - 1).reshape(-1)).reshape(n, m)
        else:
            valid, logical = ids >= 0, ids
        valid = valid & (logical < self.experts)
        column = torch.where(valid, logical, torch.full_like(logical, self.experts))  # padding -> column E
        self._bits[layer, :n].scatter_(1, column, 1)
        if self._topk is not None:
            kept = min(m, RECORD_WIDTH)
            self._topk[layer, :n, :kept] = topk_ids[:, :kept].to(torch.int16)

    def finish(self, batch: int, width: int, next_token: torch.Tensor | None = None,
               next_sibling: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The pass's statistics, still on the device (the caller copies them off without waiting).
        With the window trees' links ([B*w] first child / next sibling, -1 = none), also each node's
        path union."""
        n = batch * width
        per_token = self._bits[:, :n, :self.experts].view(self.layers, batch, width, self.experts)  # [L, B, w, E]
        unions = per_token.amax(dim=2).sum(dim=-1, dtype=torch.int32)  # [L, B]
        batch_union = per_token.reshape(self.layers, n, self.experts).amax(dim=1).sum(dim=-1, dtype=torch.int32)
        sets = per_token.float()
        overlap = sets @ sets.transpose(-1, -2)  # [L, B, w, w]: |S_i ∩ S_j|
        if width == 1:
            pair_mean = pair_min = overlap[..., 0, 0]
        else:
            off_diagonal = ~torch.eye(width, dtype=torch.bool, device=self.device)
            pair_mean = overlap.masked_fill(~off_diagonal, 0).sum(dim=(-1, -2)) / (width * (width - 1))
            pair_min = overlap.masked_fill(~off_diagonal, float("inf")).amin(dim=(-1, -2))
        out = {
            "unions": unions.t().to(torch.int16),  # [B, L]
            "batch_union": batch_union.to(torch.int16),  # [L]
            "pair_mean": pair_mean.t().float(),  # [B, L]
            "pair_min": pair_min.t().to(torch.int16),  # [B, L]
        }
        if next_token is not None and next_sibling is not None:
            paths = ancestors(next_token.view(batch, width), next_sibling.view(batch, width))  # [B, w, w]
            on_path = torch.einsum("bij,lbje->lbie", paths.to(sets.dtype), sets) > 0  # [L, B, w, E]
            out["path_unions"] = on_path.sum(dim=-1, dtype=torch.int32).permute(1, 2, 0).to(torch.int16)  # [B, w, L]
        if self._topk is not None:
            out["topk"] = self._topk[:, :n]  # [L, n, RECORD_WIDTH]
        return out


def ancestors(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """[B, w, w] bool: node j lies on node i's path (the root, i's ancestors and i itself), from each
    window's first-child / next-sibling links [B, w]. A node no link reaches hangs off the root."""
    batch, width = next_token.shape
    device = next_token.device
    nodes = torch.arange(width, device=device).expand(batch, width)

    def linked_from(links: torch.Tensor) -> torch.Tensor:
        """[B, w]: the node whose link points at each node, -1 = none (column w swallows the -1 links)."""
        source = torch.full((batch, width + 1), -1, dtype=torch.int64, device=device)
        target = torch.where(links >= 0, links.long(), torch.full_like(links, width, dtype=torch.int64))
        return source.scatter_(1, target, nodes)[:, :width]

    parent, previous = linked_from(next_token), linked_from(next_sibling)
    for _ in range(width):  # a later sibling inherits its parent along the sibling chain
        inherited = parent.gather(1, previous.clamp(min=0))
        parent = torch.where((parent < 0) & (previous >= 0), inherited, parent)
    parent = parent.clamp(min=0)  # the root (and any node no link reaches) hangs off node 0
    on_path = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
    node = nodes.clone()
    for _ in range(width):  # depth < w: w climbs reach the root from every node
        on_path.scatter_(2, node.unsqueeze(-1), True)
        node = parent.gather(1, node)
    return on_path
