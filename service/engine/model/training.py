"""What only training runs on a `Transformer`: the cache-free forward over whole rows, the
load-balancing loss of its MoE layers and the initial weights.

Apart from model.py because inference never needs them: the server loads trained weights and runs
the cached, ragged passes; `training/` (and nothing in the product) calls these.

Shape legend: B rows, T positions per row, H hidden, V vocabulary, E routed experts, m experts per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.model.transformer import Transformer


def forward_train(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (logits [B, T, V], load-balancing loss); no cache."""
    features, balance = features_train(model, tokens)
    return model.lm_head(features), balance


def features_train(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (final hidden states after the norm [B, T, H]: what the output layer and a
    draft head read, load-balancing loss); no cache."""
    features, balance, _ = features_and_aux_train(model, tokens, ())
    return features, balance


def features_and_aux_train(model: Transformer, tokens: torch.Tensor, aux_layer_ids: tuple[int, ...]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """features_train's outputs and the residual stream after each layer in `aux_layer_ids` (its
    output, pre-norm), concatenated in ascending layer order [B, T, len(ids) * H]: what an EAGLE-3
    draft reads (None when no ids)."""
    B, T = tokens.shape
    captured = []
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed_tokens(tokens)  # [B, T, H]
    balance = x.new_zeros(())
    for i, layer in enumerate(model.layers):
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
        h = layer.post_attention_layernorm(x).reshape(B * T, -1)
        if model.cfg.is_moe:
            h, logits, ids = layer.mlp(h)
            balance = balance + load_balancing_loss(logits, ids, model.cfg.num_experts)
        else:
            h = layer.mlp(h)
        x = x + h.view(B, T, -1)
        if i in aux_layer_ids:
            captured.append(x)
    aux = torch.cat(captured, dim=-1) if captured else None
    return model.norm(x), balance / max(1, len(model.layers)), aux


def load_balancing_loss(router_logits: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss: E * sum_e (fraction routed to e) * (mean prob of e)."""
    probs = router_logits.softmax(-1)  # [T, E]
    routed = F.one_hot(ids, num_experts).sum(1).float()  # [T, E]
    fraction = routed.mean(0) / ids.shape[1]
    return num_experts * (fraction * probs.mean(0)).sum()


def init_weights(model: Transformer, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            nn.init.ones_(p)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=std)
    # Residual-branch outputs start smaller so deep sums stay near unit variance.
    scale = 1.0 / math.sqrt(2 * model.cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith("down_proj"):
                p.mul_(scale)
