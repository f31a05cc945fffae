"""The SGLang backend's EP fields on dumps a real SGLang 0.5.23 recorded on this CPU
(tests/fixtures/sglang/real_cpu/), against a brute-force recount written here with plain sets over
the raw records (torch.load of the dump, not service.sglang_backend.records): ranks from the
recorded physical slots and SGLang's map, or from a placement file's dispatch rule.

The real dumps ran with SGLang's identity map; a rewritten copy routes some pairs to replica slots
(EPLB-style redundancy, the map no longer the identity) so that what is physical and what is
logical differ and a mix-up shows.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from service.engine.model.weights import MODELS_DIR
from service.routing.expert_parallel import ACTIVATION_BYTES, EPSpec, PlacementError
from service.sglang_backend.adapter import FinishedRequest, adapt
from service.sglang_backend.attribution import RequestTokens
from service.sglang_backend.ep import ep_config
from service.sglang_backend.model_config import moe_geometry
from service.sglang_backend.policy import effective_policy
from service.sglang_backend.records import load_dump
from service.types import Drafter, DraftPolicy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang" / "real_cpu"
GEOMETRY = moe_geometry(MODELS_DIR / "target")
TOKEN_BYTES = GEOMETRY.hidden_size * ACTIVATION_BYTES
TARGET_VERIFY = 5
REPLICAS = 16  # extra slots 64..79 hold experts 0..15 again


# -- the brute-force reference ---------------------------------------------------------------------


def raw_verify_passes(dump: Path) -> tuple[list[list], list[list[int]]]:
    """Routed physical slots [L][w][8] of every verify pass with routing, and the map [L][S]."""
    data = torch.load(dump, map_location="cpu", weights_only=True)
    passes = [r["topk_ids_of_layer"].tolist() for r in data["records"]
              if r["forward_mode"] == TARGET_VERIFY and (r["topk_ids_of_layer"] >= 0).any()]
    return passes, data["last_physical_to_logical_map"].tolist()


def recount_physical(slots: list, p2l: list[list[int]], ep_size: int) -> tuple[list[int], list[int], int]:
    """Ranks touched, most experts on one rank (per layer) and dispatch bytes, home rank 0."""
    touched, most, offrank = [], [], 0
    for layer_slots, layer_map in zip(slots, p2l, strict=True):
        per_rank = len(layer_map) // ep_size
        experts_on = defaultdict(set)
        for position in layer_slots:
            for slot in position:
                if slot < 0:
                    continue
                rank = slot // per_rank
                experts_on[rank].add(layer_map[slot])
                offrank += rank != 0
        touched.append(len(experts_on))
        most.append(max(len(e) for e in experts_on.values()))
    return touched, most, offrank * TOKEN_BYTES


def recount_placed(slots: list, sglang_map: list[list[int]], placement: list[list[int]],
                   ep_size: int) -> tuple[list[int], list[int], int]:
    """The same for a placement file: each pair's logical expert (through SGLang's map) goes to the
    replica on rank 0 if there is one, else to the lowest rank holding it."""
    touched, most, offrank = [], [], 0
    for layer_slots, layer_map, layer_place in zip(slots, sglang_map, placement, strict=True):
        per_rank = len(layer_place) // ep_size
        holders = defaultdict(set)
        for slot, expert in enumerate(layer_place):
            holders[expert].add(slot // per_rank)
        experts_on = defaultdict(set)
        for position in layer_slots:
            for slot in position:
                if slot < 0:
                    continue
                expert = layer_map[slot]
                rank = 0 if 0 in holders[expert] else min(holders[expert])
                experts_on[rank].add(expert)
                offrank += rank != 0
        touched.append(len(experts_on))
        most.append(max(len(e) for e in experts_on.values()))
    return touched, most, offrank * TOKEN_BYTES


# -- helpers ---------------------------------------------------------------------------------------


def with_replicas(name: str, folder: Path) -> Path:
    """A copy of a real dump whose map has 16 replica slots, with every odd token's pairs on experts
    0..15 moved to the replica slot (as EPLB would spread a hot expert's load)."""
    data = torch.load(FIXTURES / f"{name}.pt", map_location="cpu", weights_only=True)
    layers, experts = data["last_physical_to_logical_map"].shape
    data["last_physical_to_logical_map"] = torch.cat(
        [torch.arange(experts), torch.arange(REPLICAS)]).repeat(layers, 1)
    for record in data["records"]:
        ids = record["topk_ids_of_layer"]
        odd = torch.zeros_like(ids, dtype=torch.bool)
        odd[:, 1::2] = True
        move = odd & (ids >= 0) & (ids < REPLICAS)
        record["topk_ids_of_layer"] = torch.where(move, ids + experts, ids)
    path = folder / f"{name}-replicas.pt"
    torch.save(data, path)
    return path


def steps(name: str, dump: Path, ep):
    request = json.loads((FIXTURES / f"{name}.json").read_text())
    policy = effective_policy(DraftPolicy(Drafter(request["policy"]["drafter"]), request["policy"]["draft_length"],
                                          policy_id=request["policy"]["policy_id"]))
    done = FinishedRequest(RequestTokens(tuple(request["prompt_ids"]), tuple(request["output_ids"])),
                           request["meta_info"], decode_seconds=1.0)
    result = adapt(load_dump(dump), [done], policy, GEOMETRY, decode_step_seconds=0.1, ep=ep)[0]
    assert result.from_records
    return result.steps


def as_lists(step) -> tuple[list[int], list[int], int]:
    return list(step.ep_ranks_touched), list(step.ep_max_rank_experts), step.ep_dispatch_bytes


# -- the tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model_k3", "ngram_k4"])
@pytest.mark.parametrize("ep_size", [2, 8])
def test_ep_fields_equal_a_recount_of_the_recorded_slots(name, ep_size):
    found = steps(name, FIXTURES / f"{name}.pt", ep_config(EPSpec(ep_size), GEOMETRY))
    raw, p2l = raw_verify_passes(FIXTURES / f"{name}.pt")
    assert p2l == [list(range(GEOMETRY.num_experts))] * len(p2l)  # this CPU run: SGLang's identity map
    assert len(found) == len(raw)
    for step, slots in zip(found, raw, strict=True):
        assert as_lists(step) == recount_physical(slots, p2l, ep_size)
        assert all(1 <= r <= min(ep_size, u) for r, u in zip(step.ep_ranks_touched, step.unique_experts,
                                                                strict=True))


@pytest.mark.parametrize("ep_size", [4, 8, 16])
def test_replica_slots_go_to_the_rank_that_holds_them(tmp_path, ep_size):
    dump = with_replicas("model_k3", tmp_path)
    found = steps("model_k3", dump, ep_config(EPSpec(ep_size), GEOMETRY))
    raw, p2l = raw_verify_passes(dump)
    for step, slots in zip(found, raw, strict=True):
        assert as_lists(step) == recount_physical(slots, p2l, ep_size)
    # The replicas change where pairs ran, not which experts: unions are the identity run's.
    plain = steps("model_k3", FIXTURES / "model_k3.pt", None)
    assert [s.unique_experts for s in found] == [s.unique_experts for s in plain]
    moved = steps("model_k3", FIXTURES / "model_k3.pt", ep_config(EPSpec(ep_size), GEOMETRY))
    assert [s.ep_dispatch_bytes for s in found] != [s.ep_dispatch_bytes for s in moved]


def test_a_placement_file_redispatches_the_recorded_experts(tmp_path):
    ep_size, experts = 4, GEOMETRY.num_experts
    # Experts dealt round-robin over 4 ranks, plus 8 replicas (rank 3 also holds experts 0..7).
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(GEOMETRY.num_hidden_layers):
        order = torch.randperm(experts, generator=generator)
        rows.append(torch.cat([order[:54], torch.arange(8), order[54:]]))  # 72 slots, 18 per rank
    placement = torch.stack(rows)
    dump = with_replicas("ngram_k4", tmp_path)  # SGLang's own map is not the placement's
    found = steps("ngram_k4", dump, ep_config(EPSpec(ep_size, placement), GEOMETRY))
    raw, sglang_map = raw_verify_passes(dump)
    for step, slots in zip(found, raw, strict=True):
        assert as_lists(step) == recount_placed(slots, sglang_map, placement.tolist(), ep_size)


def test_a_map_the_ep_size_does_not_split_leaves_the_fields_out(tmp_path, caplog):
    # 80 slots (64 + 16 replicas) over 32 ranks: the model's 64 experts split, SGLang's slots do not.
    found = steps("model_k3", with_replicas("model_k3", tmp_path), ep_config(EPSpec(32), GEOMETRY))
    assert found and all(s.ep_ranks_touched is None and s.ep_dispatch_bytes is None for s in found)
    assert all(s.unique_experts for s in found)  # the request itself is reported as ever
    assert "do not split into 32 equal ranks" in caplog.text


def test_ep_config_checks_the_model_at_start_up():
    with pytest.raises(PlacementError, match="64 experts per layer do not split into 3"):
        ep_config(EPSpec(3), GEOMETRY)
    with pytest.raises(PlacementError, match="placement must be"):
        ep_config(EPSpec(2, torch.arange(64).repeat(7, 1)), GEOMETRY)
    # SGLang's shape has a row per decoder layer, dense ones included: only MoE rows are kept.
    dense_first = dataclasses.replace(GEOMETRY, num_hidden_layers=5, moe_layers=(1, 2, 3, 4))
    rows = torch.stack([torch.zeros(64, dtype=torch.long)] + [torch.arange(64)] * 4)  # row 0 names one expert
    assert ep_config(EPSpec(2, rows), dense_first).placement.num_layers == 4
