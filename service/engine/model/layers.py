"""The layers of the Qwen2 / Qwen2-MoE decoder: norm, attention, the dense MLP and the sparse MoE block.

Parameter names and layouts follow transformers' Qwen2 / Qwen2-MoE (the routed experts of a layer
are stacked as `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]), so the model's
state dict is the hub's up to the expert stacking `weights.py` does. Each layer keeps its eager path
(training, and inference without kernels) beside the fused one its `fuse` / `use_kernels` selects:
the window bounds below say which path a pass of a given size takes.

Shape legend: w window positions, N tokens of a ragged pass, B sequences in it, T training tokens,
H hidden, A attention heads, K kv heads, D head dim, E routed experts, m experts per token,
I expert intermediate, U experts in a window's union, S cache length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.kernels.attention import AttentionWeights
from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.library import Kernels
from service.engine.kernels.moe import MoeBlock
from service.engine.kernels.packed import PackedWeight, panel_format
from service.engine.kernels.pool import ONE_THREAD, KernelThreads
from service.engine.model.config import ModelConfig
from service.engine.model.ragged import KVCache, RaggedBatch

# Windows up to this many positions run every expert of the union on every position (a few
# batched matmuls, cost ~ U), or the fused kernel (kernels/library.py) when the model has one; longer ones
# (prefill, training) gather the tokens of each expert.
UNION_WINDOW_MAX = 16
# The fused MoE block reads each touched expert once per call and computes every position on its own,
# so it serves every pass: batched passes of many clients and prefills too (its tiled matmuls keep
# it level with the grouped path on long windows). The bound is kept to compare the two
# (`moespec bench kernel-window`).
KERNEL_WINDOW_MAX = 1 << 16


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: Kernels | None = None  # see Transformer.fuse_for_inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.is_cpu and not torch.is_grad_enabled():  # one call instead of five ops
            return self.kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense model's MLP and the MoE layer's shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.kernels: Kernels | None = None  # see use_kernels
        self.kernel_weights: tuple[PackedWeight, ...] = ()

    def use_kernels(self, kernels: Kernels | None, arena: PanelArena | None = None) -> None:
        """Inference only: short windows run in the fused kernel (its weights packed into `arena`)."""
        self.kernels = kernels
        # [1, 2I, H] and [1, H, I] packed: this MLP as the only "expert", in the kernel's layout (copies)
        gate_up, down = torch.cat([self.gate_proj.weight, self.up_proj.weight])[None], self.down_proj.weight[None]
        fmt = panel_format("fp32", gate_up, down)  # one format for both: one kernel flag
        self.kernel_weights = () if kernels is None else (PackedWeight.pack(gate_up, fmt, arena),
                                                          PackedWeight.pack(down, fmt, arena))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.shape[0] <= UNION_WINDOW_MAX and x.is_cpu \
                and not torch.is_grad_enabled():
            out = torch.empty_like(x)
            ids = torch.zeros(x.shape[0], 1, dtype=torch.long)  # [w, 1]: one "expert", this MLP, weight 1
            self.kernels.swiglu_experts(x.contiguous(), *self.kernel_weights, ids, x.new_ones(x.shape[0], 1), out,
                                        accumulate=False)
            return out
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.route(F.linear(x, self.weight))  # logits [w, E]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits [w, E] -> (logits, routing weights [w, m], expert ids [w, m])."""
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)  # [w, m]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward_union(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Short windows: gather the U experts the window touched and run each on every position."""
        union, slot = torch.unique(ids, return_inverse=True)  # [U], [w, m] index into union
        w, U = x.shape[0], union.shape[0]
        gate_up = self.gate_up_proj.index_select(0, union)  # [U, 2I, H]
        down = self.down_proj.index_select(0, union)  # [U, H, I]
        h = torch.matmul(x.unsqueeze(0), gate_up.transpose(1, 2))  # [U, w, 2I]
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [U, w, H]
        # Routing weight of each (position, union expert); zero where the position did not pick it.
        mix = x.new_zeros(w, U).scatter_(1, slot, weights)  # [w, U]
        return torch.einsum("wu,uwh->wh", mix, y)

    def forward_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Long windows and training: run each expert on the tokens that picked it."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # [T*m]
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // ids.shape[1]  # [T*m] token index of each sorted pair
        weight_of = weights.reshape(-1)[order]
        # unbind once: indexing the stacked parameter per expert would allocate a full-size
        # gradient for every expert in backward.
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)  # [n, I]
            y = F.linear(F.silu(g) * u, down[e]) * weight_of[start:start + n, None]
            out.index_add_(0, tok, y)
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None  # see fuse()
        self.kernels: Kernels | None = None
        self.block: MoeBlock | None = None
        self.kernel_window_max = KERNEL_WINDOW_MAX
        self.kernel_threads = ONE_THREAD

    def fuse(self, kernels: Kernels | None = None, kernel_window_max: int = KERNEL_WINDOW_MAX,
             kernel_threads: KernelThreads = ONE_THREAD, math: str = "fp32", arena: PanelArena | None = None) -> None:
        """Inference only: router + shared-expert gate in one matmul, shared gate/up in another;
        with kernels, passes up to kernel_window_max positions run the whole block in one kernel call
        (which keeps pointers to these weights: they must not move or be replaced afterwards)."""
        self.fused = (torch.cat([self.gate.weight, self.shared_expert_gate.weight]),  # [E+1, H]
                      torch.cat([self.shared_expert.gate_proj.weight, self.shared_expert.up_proj.weight]))
        self.kernels = kernels
        self.kernel_window_max = kernel_window_max
        self.kernel_threads = kernel_threads
        if kernels is not None:
            shared = self.shared_expert
            self.block = MoeBlock(self.fused[0], self.gate.top_k, self.gate.norm_topk_prob, self.experts.gate_up_proj,
                                  self.experts.down_proj, shared.gate_proj.weight, shared.up_proj.weight,
                                  shared.down_proj.weight, math=math, arena=arena)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [w, H] -> (out [w, H], router logits [w, E], routed ids [w, m])."""
        in_kernel_window = x.shape[0] <= self.kernel_window_max and x.is_cpu and not torch.is_grad_enabled()
        if self.kernels is not None and in_kernel_window:
            return self.forward_kernel(x.contiguous())
        if self.fused is None:
            logits, weights, ids = self.gate(x)
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        else:
            router_and_gate = F.linear(x, self.fused[0])  # [w, E+1]
            logits, weights, ids = self.gate.route(router_and_gate[:, :-1])
            g, u = F.linear(x, self.fused[1]).chunk(2, dim=-1)  # [w, Is] each
            shared = torch.sigmoid(router_and_gate[:, -1:]) * self.shared_expert.down_proj(F.silu(g) * u)
        if x.shape[0] <= UNION_WINDOW_MAX and not torch.is_grad_enabled():
            routed = self.experts.forward_union(x, ids, weights)
        else:
            routed = self.experts.forward_grouped(x, ids, weights)
        return routed + shared, logits, ids

    def forward_kernel(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused: router, top-k, routed and shared experts in one kernel call."""
        return self.kernels.moe_block(self.block, x, self.kernel_threads.moe(x.shape[0]))  # [w, H], [w, E], [w, m]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        A, K, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = A, K, D
        self.q_proj = nn.Linear(H, A * D, bias=True)
        self.k_proj = nn.Linear(H, K * D, bias=True)
        self.v_proj = nn.Linear(H, K * D, bias=True)
        self.o_proj = nn.Linear(A * D, H, bias=False)
        self.qkv: tuple[torch.Tensor, torch.Tensor] | None = None  # see fuse()
        self.block: AttentionWeights | None = None

    def fuse(self, norm: RMSNorm | None = None, math: str = "fp32", arena: PanelArena | None = None) -> None:
        """Inference only: q, k and v projections as one matmul; with `norm` (the layer's input norm),
        also the weights of the fused sub-block (Kernels.attention_block: norm, q/k/v, rope, cache
        write, attention, o_proj and the residual in one call), which keeps pointers to them."""
        self.qkv = (torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                    torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        self.block = None if norm is None else AttentionWeights(norm.weight.detach(), norm.eps, *self.qkv,
                                                                self.o_proj.weight.detach(), self.n_heads, self.n_kv,
                                                                self.head_dim, math=math, arena=arena)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.n_kv * self.head_dim
        return F.linear(x, *self.qkv).split([self.n_heads * self.head_dim, kv, kv], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training, no cache: x [B, T, H], causal over each row."""
        B, T, _ = x.shape
        q, k, v = self._project(x)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, A, T, D]
        k = k.reshape(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, K, T, D]
        v = v.reshape(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_ragged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                       batch: RaggedBatch) -> torch.Tensor:
        """x [N, H]: the windows of B sequences back to back; each attends to its own cache slot."""
        N = x.shape[0]
        q, k, v = self._project(x)
        q = apply_rope(q.view(N, self.n_heads, self.head_dim), cos, sin)  # [N, A, D]
        k = apply_rope(k.view(N, self.n_kv, self.head_dim), cos, sin)  # [N, K, D]
        keys, values = cache.write_ragged(layer, batch, k, v.view(N, self.n_kv, self.head_dim))  # [B, K, S', D]
        if batch.size == 1:  # one window: no padding to scatter into
            padded = q.unsqueeze(0)  # [1, w, A, D]
        else:
            padded = q.new_zeros(batch.size, batch.width, self.n_heads, self.head_dim)  # [B, w', A, D]
            padded[batch.row, batch.col] = q
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=batch.mask,
                                             enable_gqa=True)  # [B, A, w', D]
        out = out.transpose(1, 2)  # [B, w', A, D]
        out = out[0] if batch.size == 1 else out[batch.row, batch.col]  # [N, A, D]
        return self.o_proj(out.reshape(N, -1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
