"""Verify windows with a controlled union: w positions whose k experts each (distinct within a
position) touch exactly U distinct experts of E in every layer, k <= U <= min(w * k, E).

How: pick U experts at random, lay the w * k slots of the window over them cyclically (slot s gets
chosen[s mod U]). A position's k slots are k consecutive values mod U, distinct because k <= U; the
slots cover every chosen expert because w * k >= U. Which experts, which position is which and the
order within a position are random; how often each expert is picked is as even as the union allows
(each is picked floor or ceil(w * k / U) times), which is what the fused kernel's cost depends on
anyway: it reads each touched expert once (per 16 positions) and does w * k expert products."""

from __future__ import annotations

import torch


def union_range(window: int, top_k: int, experts: int) -> tuple[int, int]:
    return top_k, min(window * top_k, experts)


def controlled_window(window: int, top_k: int, experts: int, union: int, generator: torch.Generator) -> torch.Tensor:
    """ids [w, k] int64 with exactly `union` distinct values, each row distinct."""
    low, high = union_range(window, top_k, experts)
    if not low <= union <= high:
        raise ValueError(f"a window of {window} positions picking {top_k} of {experts} experts touches "
                         f"{low}..{high} experts, not {union}")
    chosen = torch.randperm(experts, generator=generator)[:union]
    slots = torch.arange(window * top_k) % union  # [w * k] cyclic over the chosen
    ids = chosen[slots].view(window, top_k)
    rows = torch.randperm(window, generator=generator)
    cols = torch.argsort(torch.rand(window, top_k, generator=generator), dim=1)
    return torch.gather(ids[rows], 1, cols).contiguous()


def controlled_layers(layers: int, window: int, top_k: int, experts: int, union: int,
                      generator: torch.Generator) -> torch.Tensor:
    """ids [L, w, k]: an independent controlled window per layer."""
    return torch.stack([controlled_window(window, top_k, experts, union, generator) for _ in range(layers)])


def union_grid(window: int, top_k: int, experts: int, points: int) -> list[int]:
    """Up to `points` unions spread evenly over the window's range, both ends included."""
    low, high = union_range(window, top_k, experts)
    if points <= 1 or low == high:
        return sorted({low, high}) if points > 1 else [high]
    return sorted({round(low + (high - low) * i / (points - 1)) for i in range(points)})
