"""Expert-parallel (EP) view of a verify pass: which ranks its routed experts live on, and what the
all-to-all would move, for an EP size P and an expert-to-rank placement.

Contract (pure functions; the embedded engine runs on one device, so this is an estimate of what an
EP deployment of the same model would do with the same routing):
- A placement is SGLang's `physical_to_logical_map` shape, [L, S] (S physical expert slots per
  layer, value = the logical expert held there), with slots split into P equal contiguous blocks:
  slot s lives on rank s // (S / P), as SGLang lays them out. The default is contiguous: S = E,
  slot s holds expert s. With EPLB redundancy a logical expert has slots on several ranks.
- Every position of a pass has a home rank (where its hidden state lives: the request's attention
  rank; rank 0 for the embedded engine's one request). A token-expert pair goes to the replica on
  the home rank when there is one (no traffic), else to the expert's lowest-ranked replica: SGLang's
  static dispatch, which prefers a local replica, made deterministic.
- Per pass and layer: `ranks_touched` = ranks that run at least one pair; `max_rank_experts` = the
  most distinct experts one rank runs (the straggler that sets the pass's MoE time);
  `offrank_pairs` = token-expert pairs sent off their home rank. Bytes = pairs * hidden * dtype
  bytes (dispatch; the combine sends the same volume back). With one home rank,
  1 <= ranks_touched <= min(P, unique experts).
- `view_from_physical` takes SGLang's recorder ids as they are (physical slots, -1 = no expert), so
  the SGLang backend gets the real replica each pair went to rather than this module's rule.

Shape legend: L layers, w positions of the pass, m routed experts per position, E logical experts,
S physical slots per layer, P ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class PlacementError(ValueError):
    """A placement that does not fit the model or the EP size (message names the problem)."""


@dataclass(frozen=True)
class Placement:
    """Which rank runs each (layer, home rank, logical expert) pair, and where each slot lives."""

    ep_size: int  # P
    physical_to_logical: torch.Tensor  # [L, S] long
    dispatch_rank: torch.Tensor  # [L, P, E] long: rank a pair (layer, home, expert) is sent to

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_experts(self) -> int:
        return self.dispatch_rank.shape[2]

    @property
    def slots_per_rank(self) -> int:
        return self.physical_to_logical.shape[1] // self.ep_size


def contiguous_map(num_layers: int, num_experts: int) -> torch.Tensor:
    """Identity placement: slot s holds expert s in every layer -> [L, E]."""
    return torch.arange(num_experts).repeat(num_layers, 1)


def make_placement(ep_size: int, num_layers: int, num_experts: int,
                   physical_to_logical: torch.Tensor | None = None) -> Placement:
    """Validate a physical-to-logical map (default: contiguous) and precompute the dispatch rule."""
    if ep_size < 1:
        raise PlacementError(f"EP size must be >= 1, got {ep_size}")
    p2l = contiguous_map(num_layers, num_experts) if physical_to_logical is None else physical_to_logical
    p2l = torch.as_tensor(p2l).to(torch.long)
    if p2l.dim() != 2 or p2l.shape[0] != num_layers:
        raise PlacementError(f"placement must be [layers={num_layers}, slots], got {tuple(p2l.shape)}")
    slots = p2l.shape[1]
    if slots % ep_size:
        raise PlacementError(f"{slots} expert slots per layer do not split into {ep_size} equal ranks")
    if p2l.numel() and (p2l.min() < 0 or p2l.max() >= num_experts):
        raise PlacementError(f"placement names experts outside [0, {num_experts})")
    per_rank = slots // ep_size
    slot_rank = torch.arange(slots) // per_rank  # [S]
    held = torch.zeros(num_layers, ep_size, num_experts, dtype=torch.bool)  # [L, P, E] rank holds expert
    held[torch.arange(num_layers)[:, None], slot_rank[None, :], p2l] = True
    missing = (~held.any(1)).nonzero()
    if missing.numel():
        layer, expert = missing[0].tolist()
        raise PlacementError(f"layer {layer}: expert {expert} has no slot on any rank")
    # Lowest rank holding each expert: argmax finds the first True along the rank axis.
    first = held.to(torch.int8).argmax(1)  # [L, E]
    homes = torch.arange(ep_size)[None, :, None]  # [1, P, 1]
    dispatch = torch.where(held, homes, first[:, None, :])  # [L, P, E]
    return Placement(ep_size, p2l, dispatch)


def load_placement_map(path: Path) -> torch.Tensor:
    """Read a physical-to-logical map: a torch file (a tensor, or a dict with SGLang's
    `last_physical_to_logical_map` / `physical_to_logical_map` key, as the recorder dump and
    `--init-expert-location` use) or JSON (a [L, S] list, or a dict with one of those keys)."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise PlacementError(f"cannot read placement {path}: {e}") from None
    if isinstance(data, dict):
        key = next((k for k in ("last_physical_to_logical_map", "physical_to_logical_map") if k in data), None)
        if key is None:
            raise PlacementError(f"{path}: no physical_to_logical_map in the file")
        data = data[key]
    try:
        return torch.as_tensor(data).to(torch.long)
    except (TypeError, ValueError, RuntimeError) as e:
        raise PlacementError(f"{path}: the map is not a [layers, slots] integer array ({e})") from None


@dataclass(frozen=True)
class PassView:
    """One pass under EP, per layer."""

    ranks_touched: tuple[int, ...]  # [L]
    max_rank_experts: tuple[int, ...]  # [L]
    offrank_pairs: tuple[int, ...]  # [L]
    dispatch_bytes: int  # all layers: offrank pairs * hidden * dtype bytes


def _count(dest: torch.Tensor, experts: torch.Tensor, valid: torch.Tensor, home: torch.Tensor, ep_size: int,
           width: int, bytes_per_token: int) -> PassView:
    """dest/experts/valid [L, w, m], home [w] -> per-layer counts; `experts` index a width-wide axis."""
    L = dest.shape[0]
    index = (dest * width + experts).masked_fill(~valid, 0).reshape(L, -1)  # [L, w*m]
    # Pairs per (rank, expert); an invalid pair adds 0 (scatter_ would overwrite a real pair's mark).
    pairs = torch.zeros(L, ep_size * width, dtype=torch.int32).scatter_add_(1, index, valid.reshape(L, -1).int())
    per_rank = (pairs > 0).view(L, ep_size, width).sum(-1)  # [L, P] distinct experts each rank runs
    offrank = ((dest != home[None, :, None]) & valid).sum((1, 2))  # [L]
    return PassView(
        ranks_touched=tuple((per_rank > 0).sum(-1).tolist()),
        max_rank_experts=tuple(per_rank.max(-1).values.tolist()),
        offrank_pairs=tuple(offrank.tolist()),
        dispatch_bytes=int(offrank.sum()) * bytes_per_token,
    )


def pass_view(placement: Placement, topk_ids: torch.Tensor, bytes_per_token: int,
              home_ranks: torch.Tensor | None = None) -> PassView:
    """Logical routed ids [L, w, m] of one pass -> its EP view (pairs dispatched by the placement's rule).

    `bytes_per_token` = hidden size * dtype bytes; `home_ranks` [w] defaults to rank 0 for all.
    Ids < 0 (no expert: padding) are ignored.
    """
    L, w, _ = topk_ids.shape
    ids = topk_ids.to(torch.long)
    home = torch.zeros(w, dtype=torch.long) if home_ranks is None else home_ranks.to(torch.long)
    valid = ids >= 0
    safe = ids.clamp(min=0)
    layer = torch.arange(L)[:, None, None]
    dest = placement.dispatch_rank[layer, home[None, :, None], safe]  # [L, w, m]
    return _count(dest, safe, valid, home, placement.ep_size, placement.num_experts, bytes_per_token)


def view_from_physical(physical_ids: torch.Tensor, physical_to_logical: torch.Tensor, ep_size: int,
                       bytes_per_token: int, home_ranks: torch.Tensor | None = None) -> PassView:
    """The same view from physical slot ids [L, w, m] as SGLang's recorder writes them (-1 = none).

    The slot says where the pair really went: rank = slot // (S / P); the expert a rank runs is the
    logical one in that slot (two slots of one expert on one rank count once).
    """
    p2l = physical_to_logical.to(torch.long)
    slots = p2l.shape[1]
    if slots % ep_size:
        raise PlacementError(f"{slots} expert slots per layer do not split into {ep_size} equal ranks")
    L, w, _ = physical_ids.shape
    ids = physical_ids.to(torch.long)
    valid = (ids >= 0) & (ids < slots)
    safe = ids.clamp(0, slots - 1)
    dest = safe // (slots // ep_size)  # [L, w, m]
    logical = torch.gather(p2l, 1, safe.reshape(L, -1)).reshape(L, w, -1)
    home = torch.zeros(w, dtype=torch.long) if home_ranks is None else home_ranks.to(torch.long)
    width = int(p2l.max()) + 1 if p2l.numel() else 1
    return _count(dest, logical, valid, home, ep_size, width, bytes_per_token)


@dataclass(frozen=True)
class EPSpec:
    """What `moespec serve --ep-size P [--ep-placement FILE]` asks the engine to estimate."""

    size: int
    physical_to_logical: torch.Tensor | None = None  # [L, S]; None = contiguous
    dtype_bytes: int = 2  # bf16 activations, as a real deployment would send


def step_fields(view: PassView) -> dict:
    """The optional StepRecord fields for one pass's EP view."""
    return {
        "ep_ranks_touched": view.ranks_touched,
        "ep_max_rank_experts": view.max_rank_experts,
        "ep_dispatch_bytes": view.dispatch_bytes,
    }
