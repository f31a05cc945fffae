"""The EP view against a brute-force recount with Python sets, for random routing and placements
(contiguous, shuffled, and EPLB-style with redundant experts on two ranks), plus the SGLang path
from physical slot ids and the placement file / validation errors.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from service.routing.expert_parallel import (
    PlacementError,
    load_placement_map,
    make_placement,
    pass_view,
    view_from_physical,
)

L, E, M = 3, 16, 4
HIDDEN_BYTES = 256 * 2


def brute_force(p2l: list[list[int]], ep_size: int, topk: list, homes: list[int]) -> tuple[list, list, list]:
    """Loop over every pair: replica on the home rank if any, else the lowest rank holding the expert."""
    per_rank = len(p2l[0]) // ep_size
    ranks, most, offrank = [], [], []
    for layer, positions in enumerate(topk):
        holders: dict[int, set[int]] = {}
        for slot, expert in enumerate(p2l[layer]):
            holders.setdefault(expert, set()).add(slot // per_rank)
        run: dict[int, set[int]] = {}
        off = 0
        for home, experts in zip(homes, positions, strict=True):
            for expert in experts:
                if expert < 0:
                    continue
                rank = home if home in holders[expert] else min(holders[expert])
                run.setdefault(rank, set()).add(expert)
                off += rank != home
        ranks.append(len(run))
        most.append(max(len(s) for s in run.values()))
        offrank.append(off)
    return ranks, most, offrank


def random_topk(rng: random.Random, w: int) -> list:
    return [[rng.sample(range(E), M) for _ in range(w)] for _ in range(L)]


def redundant_map(rng: random.Random, ep_size: int, extra_per_rank: int) -> list[list[int]]:
    """Every expert once (shuffled) plus `extra_per_rank` replicas per rank of experts held elsewhere."""
    layers = []
    for _ in range(L):
        experts = list(range(E))
        rng.shuffle(experts)
        base = E // ep_size
        slots = []
        for r in range(ep_size):
            own = experts[r * base:(r + 1) * base]
            others = [e for e in experts if e not in own]
            slots += own + rng.sample(others, min(extra_per_rank, len(others)))
        layers.append(slots)
    return layers


@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["contiguous", "shuffled", "redundant"])
def test_ep_counts_match_a_brute_force_recount(ep_size: int, kind: str) -> None:
    rng = random.Random(ep_size * 31 + len(kind))
    for trial in range(20):
        if kind == "contiguous":
            p2l = [list(range(E)) for _ in range(L)]
        elif kind == "shuffled":
            p2l = [rng.sample(range(E), E) for _ in range(L)]
        else:
            p2l = redundant_map(rng, ep_size, extra_per_rank=2)
        placement = make_placement(ep_size, L, E, torch.tensor(p2l) if kind != "contiguous" else None)
        w = rng.randint(1, 9)
        topk = random_topk(rng, w)
        homes = [0] * w if trial % 2 == 0 else [rng.randrange(ep_size) for _ in range(w)]
        view = pass_view(placement, torch.tensor(topk), HIDDEN_BYTES, torch.tensor(homes))
        ranks, most, offrank = brute_force(p2l, ep_size, topk, homes)
        assert list(view.ranks_touched) == ranks
        assert list(view.max_rank_experts) == most
        assert list(view.offrank_pairs) == offrank
        assert view.dispatch_bytes == sum(offrank) * HIDDEN_BYTES


def test_a_redundant_expert_is_served_locally_when_the_home_rank_holds_a_replica() -> None:
    # Two ranks of 3 slots. Layer 0: expert 3 on both ranks (slots 2 and 4); layer 1: only on rank 1.
    p2l = torch.tensor([[0, 1, 3, 2, 3, 0], [0, 1, 2, 3, 0, 1]])
    placement = make_placement(2, 2, 4, p2l)
    topk = torch.tensor([[[3]], [[3]]])  # [L=2, w=1, m=1]
    from_rank1 = pass_view(placement, topk, 10, torch.tensor([1]))
    assert from_rank1.offrank_pairs == (0, 0)  # layer 0: its own replica; layer 1: expert 3 is on rank 1
    from_rank0 = pass_view(placement, topk, 10, torch.tensor([0]))
    assert from_rank0.offrank_pairs == (0, 1) and from_rank0.dispatch_bytes == 10


def test_ranks_touched_lies_between_one_and_min_of_ranks_and_unique_experts() -> None:
    rng = random.Random(7)
    for ep_size in (2, 4, 16):
        placement = make_placement(ep_size, L, E)
        for _ in range(50):
            topk = random_topk(rng, rng.randint(1, 9))
            view = pass_view(placement, torch.tensor(topk), HIDDEN_BYTES)
            for layer, ranks in enumerate(view.ranks_touched):
                unique = len({e for pos in topk[layer] for e in pos})
                assert 1 <= ranks <= min(ep_size, unique)
                assert 1 <= view.max_rank_experts[layer] <= unique


def test_physical_ids_give_the_same_view_when_each_pair_names_the_rule_s_replica() -> None:
    """SGLang path: translate each logical pair to the slot the rule picks; both views must agree."""
    rng = random.Random(3)
    ep_size = 4
    p2l = redundant_map(rng, ep_size, extra_per_rank=1)
    placement = make_placement(ep_size, L, E, torch.tensor(p2l))
    per_rank = len(p2l[0]) // ep_size
    topk = random_topk(rng, 6)
    physical = [[[next(s for s, e in enumerate(p2l[layer])
                       if e == expert and s // per_rank == int(placement.dispatch_rank[layer, 0, expert]))
                  for expert in pos] + [-1] for pos in positions] for layer, positions in enumerate(topk)]
    real = view_from_physical(torch.tensor(physical), torch.tensor(p2l), ep_size, HIDDEN_BYTES)
    assert real == pass_view(placement, torch.tensor(topk), HIDDEN_BYTES)


def test_padding_ids_are_ignored() -> None:
    placement = make_placement(2, 1, 4)
    view = pass_view(placement, torch.tensor([[[1, -1], [3, -1]]]), 1)  # expert 0 unused: padding must not mark it
    assert view.ranks_touched == (2,) and view.max_rank_experts == (1,) and view.offrank_pairs == (1,)


def test_placement_files_in_sglang_shapes_load(tmp_path) -> None:
    p2l = torch.tensor([list(range(E)) + [0, 1, 2, 3]] * L)
    torch.save({"records": [], "last_physical_to_logical_map": p2l}, tmp_path / "dump.pt")
    (tmp_path / "eplb.json").write_text(json.dumps({"physical_to_logical_map": p2l.tolist()}))
    for name in ("dump.pt", "eplb.json"):
        loaded = load_placement_map(tmp_path / name)
        assert torch.equal(loaded, p2l)
        assert make_placement(4, L, E, loaded).slots_per_rank == 5


@pytest.mark.parametrize(("p2l", "ep_size", "message"), [
    (torch.arange(E).repeat(L, 1), 3, "do not split into 3"),
    (torch.arange(E).repeat(L + 1, 1), 2, "layers=3"),
    (torch.tensor([[0] * E] * L), 2, "expert 1 has no slot"),
    (torch.tensor([[E] * E] * L), 2, "outside [0, 16)"),
])
def test_a_placement_that_does_not_fit_is_refused_with_the_reason(p2l, ep_size, message) -> None:
    with pytest.raises(PlacementError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_placement(ep_size, L, E, p2l)


def test_an_unreadable_placement_file_names_the_file(tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlacementError, match="bad.json"):
        load_placement_map(tmp_path / "bad.json")
    (tmp_path / "nokey.json").write_text("{}")
    with pytest.raises(PlacementError, match="no physical_to_logical_map"):
        load_placement_map(tmp_path / "nokey.json")
