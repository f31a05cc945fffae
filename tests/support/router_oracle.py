"""transformers' own Qwen2-MoE router over the shipped target: the independent count of which experts
a token routes to, given everything it attends to."""

from __future__ import annotations

import torch


def load_router_oracle():
    """The shipped target in transformers, fp32 (skips the test where transformers is not installed)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from service.engine.model.weights import DEFAULT_TARGET_DIR

    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()


def oracle_routed(oracle, ids: list[int]) -> torch.Tensor:
    """[L, len(ids), m] the experts transformers' router picks at every position of ids."""
    with torch.no_grad():
        out = oracle(torch.tensor([ids]), output_router_logits=True)
    m = oracle.config.num_experts_per_tok
    return torch.stack([logits.topk(m, dim=-1).indices for logits in out.router_logits])


def tree_routed(oracle, committed: list[int], window: list[int], parents: tuple[int, ...]) -> torch.Tensor:
    """[L, w, m] a tree window's routing as each position sees it: window[0] (the last committed token)
    after the committed prefix, node i (window[i + 1]) after the prefix and its own path (parents: -1 =
    window[0])."""
    per_node = []
    for node in range(len(window)):
        path, i = [], node - 1
        while i >= 0:
            path.append(window[1 + i])
            i = parents[i]
        per_node.append(oracle_routed(oracle, committed + path[::-1])[:, -1])  # [L, m]
    return torch.stack(per_node, dim=1)


def distinct(routed: torch.Tensor) -> tuple[int, ...]:
    """[L] distinct experts per layer of [L, n, m] ids."""
    return tuple(len(set(layer.flatten().tolist())) for layer in routed)
