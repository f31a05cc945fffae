"""PassStatistics (the plugin's per-pass device math) against plain Python sets over the same ids."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from service.sglang_plugin.statistics import PassStatistics


def routed(rng: random.Random, layers: int, tokens: int, slots: int, m: int, pad_rows: int = 0) -> torch.Tensor:
    """[L, n, m] physical ids; the last pad_rows rows are -1 (SGLang pads rows it did not route)."""
    ids = torch.tensor([[rng.sample(range(slots), m) for _ in range(tokens)] for _ in range(layers)])
    if pad_rows:
        ids[:, tokens - pad_rows:] = -1
    return ids


def reference(ids: torch.Tensor, batch: int, width: int, to_logical=None):
    """Per request and layer: the window's union, the pairwise intersections' mean and min; the pass's union."""
    layers = ids.shape[0]
    sets = [[{int(to_logical[layer][e]) if to_logical is not None else int(e) for e in ids[layer, t] if e >= 0}
             for t in range(ids.shape[1])] for layer in range(layers)]
    unions, means, mins = [], [], []
    for b in range(batch):
        window = [[sets[layer][t] for t in range(b * width, (b + 1) * width)] for layer in range(layers)]
        unions.append([len(set().union(*w)) for w in window])
        pairs = [[len(x & y) for x, y in itertools.combinations(w, 2)] or [len(w[0])] for w in window]
        means.append([sum(p) / len(p) for p in pairs])
        mins.append([min(p) for p in pairs])
    batch_union = [len(set().union(*sets[layer][:batch * width])) for layer in range(layers)]
    return unions, means, mins, batch_union


def run(stats: PassStatistics, ids: torch.Tensor, batch: int, width: int, skip_layers=()):
    stats.begin(batch * width)
    for layer in range(ids.shape[0]):
        if layer not in skip_layers:  # a dense layer: no routing call
            stats.on_routed(layer, ids[layer])
    return stats.finish(batch, width)


@pytest.mark.parametrize(("batch", "width"), [(1, 1), (3, 1), (1, 5), (4, 4)])
def test_unions_and_pairwise_overlap_equal_a_recount_by_sets(batch, width):
    rng = random.Random(batch * 10 + width)
    ids = routed(rng, layers=3, tokens=batch * width, slots=16, m=4)
    got = run(PassStatistics(3, 16, None, torch.device("cpu"), capture_topk=False), ids, batch, width)
    unions, means, mins, batch_union = reference(ids, batch, width)
    assert got["unions"].tolist() == unions
    assert got["pair_min"].tolist() == mins
    assert torch.allclose(got["pair_mean"], torch.tensor(means, dtype=torch.float32))
    assert got["batch_union"].tolist() == batch_union


def test_redundant_slots_count_their_expert_once_and_padding_counts_nothing():
    rng = random.Random(7)
    to_logical = torch.arange(20).repeat(2, 1) % 16  # slots 16..19 are replicas of experts 0..3
    ids = routed(rng, layers=2, tokens=6, slots=20, m=4, pad_rows=1)
    got = run(PassStatistics(2, 16, to_logical, torch.device("cpu"), capture_topk=True), ids, 2, 3)
    unions, _, mins, batch_union = reference(ids, 2, 3, to_logical.tolist())
    assert got["unions"].tolist() == unions and got["batch_union"].tolist() == batch_union
    assert got["pair_min"].tolist() == mins
    assert torch.equal(got["topk"][:, :, :4].long(), ids)  # the physical ids as routed, padding -1


def test_a_pass_leaves_nothing_behind_for_the_next_one():
    """A dense layer is never routed: the next pass must not see the previous pass's ids there."""
    rng = random.Random(3)
    stats = PassStatistics(2, 16, None, torch.device("cpu"), capture_topk=False)
    run(stats, routed(rng, 2, 8, 16, 4), 2, 4)
    ids = routed(rng, 2, 4, 16, 4)
    got = run(stats, ids, 1, 4, skip_layers=(0,))
    assert got["unions"][0, 0] == 0 and got["unions"][0, 1] == reference(ids, 1, 4)[0][0][1]


def test_a_larger_pass_grows_the_buffers():
    rng = random.Random(5)
    stats = PassStatistics(1, 16, None, torch.device("cpu"), capture_topk=False)
    run(stats, routed(rng, 1, 4, 16, 4), 1, 4)
    small = stats.capacity
    ids = routed(rng, 1, small + 8, 16, 4)
    got = run(stats, ids, small + 8, 1)
    assert stats.capacity > small and got["unions"].tolist() == reference(ids, small + 8, 1)[0]


def random_tree(rng: random.Random, width: int) -> list[int]:
    """Parents of a window of `width` nodes in BFS order (node 0 the root, -1), as SGLang's trees come."""
    parents = [-1]
    for node in range(1, width):
        parents.append(rng.randrange(node) if rng.random() < 0.7 else parents[-1] if node > 1 else 0)
    return sorted(parents[:1]) + sorted(parents[1:])  # BFS: parents in ascending order


def links(parents: list[int]) -> tuple[list[int], list[int]]:
    """SGLang's first-child / next-sibling links of a tree (children in ascending order)."""
    first, sibling = [-1] * len(parents), [-1] * len(parents)
    for node in range(len(parents) - 1, 0, -1):
        sibling[node], first[parents[node]] = first[parents[node]], node
    return first, sibling


@pytest.mark.parametrize(("batch", "width"), [(1, 2), (1, 7), (3, 5), (2, 9)])
def test_path_unions_equal_a_recount_over_each_nodes_root_path(batch, width):
    """Random trees, one per request: each node's path union is the union of its ancestors' and its own
    expert sets (root included), by plain Python over the same ids."""
    rng = random.Random(batch * 100 + width)
    trees = [random_tree(rng, width) for _ in range(batch)]
    first, sibling = zip(*(links(t) for t in trees), strict=True)
    ids = routed(rng, layers=2, tokens=batch * width, slots=32, m=4)
    stats = PassStatistics(2, 32, None, torch.device("cpu"), capture_topk=False)
    stats.begin(batch * width)
    for layer in range(2):
        stats.on_routed(layer, ids[layer])
    got = stats.finish(batch, width, torch.tensor(sum(first, []), dtype=torch.int16),
                       torch.tensor(sum(sibling, []), dtype=torch.int16))
    for b, parents in enumerate(trees):
        for node in range(width):
            path, i = [], node
            while i >= 0:
                path.append(b * width + i)
                i = parents[i]
            want = [len({int(e) for t in path for e in ids[layer, t]}) for layer in range(2)]
            assert got["path_unions"][b, node].tolist() == want, (parents, node)
    assert got["unions"].tolist() == reference(ids, batch, width)[0]  # the whole tree's, as for a chain
    chain = stats.finish(batch, width)
    assert "path_unions" not in chain
