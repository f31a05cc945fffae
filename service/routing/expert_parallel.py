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
- A batch pass (continuous batching) gets the same view over all its positions (`pass_fields`):
  what the EP deployment would run for the pass, not the sum of its requests' views.

Shape legend: L layers, w positions of the pass, m routed experts per position, E logical experts,
S physical slots per layer, P ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class PlacementError(ValueError):
    """A placement that does not fit the model or the EP size (message names the problem)."""


@dataclass(frozen=True)
class Placement:
    """Which rank runs each (layer, home rank, logical expert) pair, and where each slot lives."""

    ep_size: int  # P
    physical_to_logical: torch.Tensor  # [L, S] long
    dispatch_rank: np.ndarray  # [L, P, E] int64: rank a pair (layer, home, expert) is sent to

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
    return Placement(ep_size, p2l, dispatch.numpy())


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


def _count(dest: np.ndarray, experts: np.ndarray, valid: np.ndarray, home: np.ndarray, ep_size: int,
           width: int, bytes_per_token: int) -> PassView:
    """dest/experts/valid [L, w, m], home [w] -> per-layer counts; `experts` index a width-wide axis.

    NumPy, not torch: a pass is a few hundred pairs, where torch's per-op overhead would dominate.
    """
    L = dest.shape[0]
    trash = ep_size * width  # invalid pairs (padding) land in one extra column that is never read
    index = np.where(valid, dest * width + experts, trash).reshape(L, -1)  # [L, w*m]
    touched = np.zeros((L, trash + 1), dtype=bool)
    touched[np.arange(L)[:, None], index] = True
    per_rank = touched[:, :trash].reshape(L, ep_size, width).sum(-1)  # [L, P] distinct experts each rank runs
    offrank = ((dest != home[None, :, None]) & valid).sum((1, 2))  # [L]
    return PassView(
        ranks_touched=tuple((per_rank > 0).sum(-1).tolist()),
        max_rank_experts=tuple(per_rank.max(-1).tolist()),
        offrank_pairs=tuple(offrank.tolist()),
        dispatch_bytes=int(offrank.sum()) * bytes_per_token,
    )


def _array(x) -> np.ndarray:
    """int64 array from a tensor on any device, an array or nested lists."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def _homes(home_ranks, w: int) -> np.ndarray:
    return np.zeros(w, dtype=np.int64) if home_ranks is None else _array(home_ranks)


def pass_view(placement: Placement, topk_ids, bytes_per_token: int, home_ranks=None) -> PassView:
    """Logical routed ids [L, w, m] (tensor or array) of one pass -> its EP view (pairs dispatched
    by the placement's rule). `bytes_per_token` = hidden size * dtype bytes; `home_ranks` [w]
    defaults to rank 0 for all. Ids < 0 (no expert: padding) are ignored.
    """
    ids = _array(topk_ids)
    L, w, _ = ids.shape
    home = _homes(home_ranks, w)
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    dest = placement.dispatch_rank[np.arange(L)[:, None, None], home[None, :, None], safe]  # [L, w, m]
    return _count(dest, safe, valid, home, placement.ep_size, placement.num_experts, bytes_per_token)


def view_from_physical(physical_ids, physical_to_logical, ep_size: int, bytes_per_token: int,
                       home_ranks=None) -> PassView:
    """The same view from physical slot ids [L, w, m] as SGLang's recorder writes them (-1 = none).

    The slot says where the pair really went: rank = slot // (S / P); the expert a rank runs is the
    logical one in that slot (two slots of one expert on one rank count once).
    """
    p2l = _array(physical_to_logical)
    slots = p2l.shape[1]
    if slots % ep_size:
        raise PlacementError(f"{slots} expert slots per layer do not split into {ep_size} equal ranks")
    ids = _array(physical_ids)
    L, w, _ = ids.shape
    valid = (ids >= 0) & (ids < slots)
    safe = np.where(valid, ids, 0)
    dest = safe // (slots // ep_size)  # [L, w, m]
    logical = np.take_along_axis(p2l, safe.reshape(L, -1), 1).reshape(ids.shape)
    width = int(p2l.max()) + 1 if p2l.size else 1
    return _count(dest, logical, valid, _homes(home_ranks, w), ep_size, width, bytes_per_token)


ACTIVATION_BYTES = 2  # bf16 hidden states, what a real EP deployment sends


@dataclass(frozen=True)
class EPSpec:
    """What `moespec serve --ep-size P [--ep-placement FILE]` asks the engine to estimate."""

    size: int
    physical_to_logical: torch.Tensor | None = None  # [L, S]; None = contiguous
    dtype_bytes: int = ACTIVATION_BYTES


def step_fields(view: PassView) -> dict:
    """The optional EP fields of a StepRecord or a BatchPassRecord (same names) for one view."""
    return {
        "ep_ranks_touched": view.ranks_touched,
        "ep_max_rank_experts": view.max_rank_experts,
        "ep_dispatch_bytes": view.dispatch_bytes,
    }


def pass_fields(placement: Placement, routed_ids, bytes_per_token: int) -> dict:
    """The EP fields of routed ids [L, w, m]: one request's window (a StepRecord), or a whole batch
    pass, every request's window back to back (a BatchPassRecord). Every position's home is rank 0
    (the embedded engine is one attention rank), so a pass's dispatch bytes are the sum of its
    requests' and its ranks and straggler per layer are at least any one request's: the pass runs all
    their pairs at once."""
    return step_fields(pass_view(placement, routed_ids, bytes_per_token))
