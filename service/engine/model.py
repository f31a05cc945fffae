"""Qwen2 / Qwen2-MoE decoder in plain PyTorch, for inference with a static KV cache and for training.

Contract:
- Parameter names and layouts follow transformers' Qwen2 / Qwen2-MoE (the routed experts of a layer
  are stacked as `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]); `weights.py`
  converts to and from the per-expert hub layout that transformers and SGLang load.
- `forward(tokens, start)` runs a window of w consecutive positions starting at `start`, writes
  their keys/values into the static cache at those positions and attends to everything before.
  `forward_ragged(tokens, batch)` does the same for the windows of several sequences in one pass
  (continuous batching), each in its own cache slot (`RaggedBatch`, `KVCache`).
  Slots of rejected draft tokens are never rolled back: the next window simply overwrites them.
- Each MoE layer reports the routed top-m expert ids of every position in the window, so the
  caller can count the distinct experts a verification pass touched (the union).
- `fuse_for_inference(kernels)` selects the fast step: on CPU, every pass runs each layer's attention
  sub-block in one kernel call (attention_kernel.py: no padding, no mask, every token at its own slot
  and position; prefill passes too), passes of up to kernel_window_max positions the MoE block too,
  windows of up to UNION_WINDOW_MAX the MLPs and the output layer too (kernels.py); in all of them
  each position's result does not depend on the rest of its pass; `math="bf16"` runs their matrix
  products in bf16 arithmetic (packed.py), still row by row. Without kernels, the eager step.

Shape legend: w window positions, N tokens of a ragged pass, B sequences in it, T training tokens,
H hidden, A attention heads, K kv heads, D head dim, E routed experts, m experts per token,
I expert intermediate, U experts in a window's union, V vocabulary, S cache length.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.attention_kernel import AttentionPass, AttentionWeights
from service.engine.kernel_pool import ONE_THREAD, KernelThreads
from service.engine.kernels import Kernels
from service.engine.moe_kernel import MoeBlock
from service.engine.packed import PackedWeight, panel_format

# Windows up to this many positions run every expert of the union on every position (a few
# batched matmuls, cost ~ U), or the fused kernel (kernels.py) when the model has one; longer ones
# (prefill, training) gather the tokens of each expert.
UNION_WINDOW_MAX = 16
# The fused MoE block reads each touched expert once per call and computes every position on its own,
# so it serves every pass: batched passes of many clients and prefills too. With its tiled matmuls it
# beat the grouped path on a 16 x 95-token prefill (150 vs 168 ms for the whole prefill, one thread);
# the bound is kept to compare against the grouped path (`moespec bench kernel-window`).
KERNEL_WINDOW_MAX = 1 << 16


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen2_moe" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen2_moe" and self.num_experts > 0

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        raw = json.loads(Path(path).read_text())
        rope = raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        fields = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs["rope_theta"] = float(theta)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """The config.json that transformers and SGLang read."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "bfloat16"
        d["use_sliding_window"] = False
        d["attention_dropout"] = 0.0
        if self.is_moe:
            d["architectures"] = ["Qwen2MoeForCausalLM"]
            d["decoder_sparse_step"] = 1
            d["mlp_only_layers"] = []
            d["qkv_bias"] = True
            d["output_router_logits"] = False
            d["router_aux_loss_coef"] = 0.001
        else:
            d["architectures"] = ["Qwen2ForCausalLM"]
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "norm_topk_prob"):
                d.pop(k)
        return d


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

    def use_kernels(self, kernels: Kernels | None) -> None:
        """Inference only: short windows run in the fused kernel."""
        self.kernels = kernels
        # [1, 2I, H] and [1, H, I] packed: this MLP as the only "expert", in the kernel's layout (copies)
        gate_up, down = torch.cat([self.gate_proj.weight, self.up_proj.weight])[None], self.down_proj.weight[None]
        fmt = panel_format("fp32", gate_up, down)  # one format for both: one kernel flag
        self.kernel_weights = () if kernels is None else (PackedWeight.pack(gate_up, fmt),
                                                          PackedWeight.pack(down, fmt))

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
             kernel_threads: KernelThreads = ONE_THREAD, math: str = "fp32") -> None:
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
                                  shared.down_proj.weight, math=math)

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

    def fuse(self, norm: RMSNorm | None = None, math: str = "fp32") -> None:
        """Inference only: q, k and v projections as one matmul; with `norm` (the layer's input norm),
        also the weights of the fused sub-block (Kernels.attention_block: norm, q/k/v, rope, cache
        write, attention, o_proj and the residual in one call), which keeps pointers to them."""
        self.qkv = (torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                    torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        self.block = None if norm is None else AttentionWeights(norm.weight.detach(), norm.eps, *self.qkv,
                                                                self.o_proj.weight.detach(), self.n_heads, self.n_kv,
                                                                self.head_dim, math=math)

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


@dataclass(frozen=True)
class RaggedBatch:
    """Where the N tokens of one pass go: B sequences, sequence b a window of lengths[b] tokens at
    positions starts[b].. in cache slot slots[b], concatenated in that order.

    The fused attention kernel needs only `positions` and `token_slot` (built with the batch: a step
    builds one per pass). Eager (padded) attention also needs `row`, `col` and `mask`, made on first
    use: queries are laid out [B, w'] (w' the longest window) and each sequence sees its own slot's
    keys up to S' = max(starts + lengths); `mask` [B, 1, w', S'] keeps row i of sequence b to keys <=
    starts[b] + i (its prefix and its window up to itself). Padding rows see key 0 only through that
    rule, so they never produce NaN; their outputs are dropped.
    """

    slots: torch.Tensor  # [B] cache slot of each sequence
    starts: tuple[int, ...]  # [B] position of each window's first token
    lengths: tuple[int, ...]  # [B] tokens in each window
    positions: torch.Tensor  # [N] absolute position of each token
    token_slot: torch.Tensor  # [N] cache slot of each token
    width: int  # w': the longest window
    span: int  # S': keys any sequence attends to

    @property
    def size(self) -> int:
        return len(self.starts)

    @functools.cached_property
    def row(self) -> torch.Tensor:
        """[N] sequence index b of each token."""
        return torch.repeat_interleave(torch.arange(self.size), torch.tensor(self.lengths))

    @functools.cached_property
    def col(self) -> torch.Tensor:
        """[N] index of each token inside its window."""
        return torch.cat([torch.arange(n) for n in self.lengths])

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, w', S'] (None: one single-token window, which sees everything)."""
        if self.size == 1 and self.width == 1:
            return None
        # [B, w']: the last key each row sees
        visible = torch.tensor(self.starts)[:, None] + torch.arange(self.width)[None, :]
        return (torch.arange(self.span)[None, None, :] <= visible[:, :, None]).unsqueeze(1)

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int]) -> RaggedBatch:
        if not slots or len(slots) != len(starts) or len(slots) != len(lengths) or min(lengths) < 1:
            raise ValueError(f"need one or more windows of >= 1 token, got {lengths}")
        # Plain lists, one tensor each at the end: a batched step builds this every pass, and small
        # torch ops cost more than the Python here.
        positions = [start + i for start, n in zip(starts, lengths, strict=True) for i in range(n)]
        token_slot = [slot for slot, n in zip(slots, lengths, strict=True) for _ in range(n)]
        return cls(slots=torch.tensor(slots), starts=tuple(starts), lengths=tuple(lengths),
                   positions=torch.tensor(positions), token_slot=torch.tensor(token_slot), width=max(lengths),
                   span=max(start + n for start, n in zip(starts, lengths, strict=True)))


class KVCache:
    """Static cache [L, slots, K, S, D]: one slot per sequence in flight; positions are written
    explicitly and never rolled back (a rejected draft's slot is overwritten by the next window)."""

    def __init__(self, cfg: ModelConfig, max_len: int, slots: int = 1, dtype: torch.dtype = torch.float32):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.slots = slots

    def write_ragged(self, layer: int, batch: RaggedBatch, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, K, D] at each token's (slot, position) -> the batch's keys, values [B, K, S', D]."""
        ck, cv = self.k[layer], self.v[layer]  # [slots, K, S, D]
        if batch.size == 1:  # one window: contiguous positions, written and read through views
            slot, start = int(batch.slots[0]), batch.starts[0]
            ck[slot, :, start:batch.span] = k.transpose(0, 1)  # [K, w, D]
            cv[slot, :, start:batch.span] = v.transpose(0, 1)
            return ck[slot:slot + 1, :, :batch.span], cv[slot:slot + 1, :, :batch.span]
        ck[batch.token_slot, :, batch.positions] = k
        cv[batch.token_slot, :, batch.positions] = v
        # index_select on the first dim is a plain row copy (advanced indexing here is several times slower)
        return ck[:, :, :batch.span].index_select(0, batch.slots), cv[:, :, :batch.span].index_select(0, batch.slots)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [w, V]
    routed_ids: torch.Tensor | None  # [L, w, m] for MoE models
    features: torch.Tensor | None = None  # [w, H] final hidden states after the norm (what a draft head reads)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)  # [S, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [S, D]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.kernels: Kernels | None = None  # see fuse_for_inference
        self.lm_head_packed: PackedWeight | None = None  # the output layer in the kernels' layout
        self.kernel_window_max = KERNEL_WINDOW_MAX
        self.kernel_threads = ONE_THREAD
        self.fused_attention = False

    def fuse_for_inference(self, kernels: Kernels | None = None, kernel_window_max: int = KERNEL_WINDOW_MAX,
                           fused_attention: bool = True, kernel_threads: KernelThreads = ONE_THREAD,
                           math: str = "fp32") -> None:
        """Concatenate projections that read the same input, for fewer matmuls per step; with kernels
        (kernels.build()), also the fast step: passes up to `kernel_window_max` positions run each
        layer's attention sub-block (unless `fused_attention` is False: the previous fast step, kept
        to measure against) and MoE block in one kernel call each, the output layer too, short windows
        the MLPs, every norm its own call; `kernel_threads` says when a call splits its positions over
        threads. Without kernels, the previous eager step.

        The fused tensors are copies: call after the weights are final (training never fuses).
        """
        for layer in self.layers:
            layer.self_attn.fuse(layer.input_layernorm if kernels is not None and fused_attention else None, math)
            if self.cfg.is_moe:
                layer.mlp.fuse(kernels, kernel_window_max, kernel_threads, math)
            else:
                layer.mlp.use_kernels(kernels)
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.kernels = kernels
        self.kernels = kernels
        self.lm_head_packed = None if kernels is None else PackedWeight.pack(
            self.lm_head.weight, panel_format(math, self.lm_head.weight))
        self.kernel_window_max = kernel_window_max
        self.kernel_threads = kernel_threads
        self.fused_attention = kernels is not None and fused_attention

    def output_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [w, H] -> logits [w, V]; in the kernel up to kernel_window_max rows (the
        largest single weight of a decode step; the kernel keeps rows independent, which sgemm does not)."""
        in_window = h.shape[0] <= self.kernel_window_max and h.is_cpu and not torch.is_grad_enabled()
        if self.kernels is not None and in_window:
            return self.kernels.linear(h.contiguous(), self.lm_head_packed, self.kernel_threads.linear(h.shape[0]))
        return self.lm_head(h)

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, slot: int = 0) -> ForwardOutput:
        """tokens [w] at positions start..start+w-1 of cache slot `slot` -> logits [w, V] and the routed ids."""
        return self.forward_ragged(tokens, RaggedBatch.build([slot], [start], [tokens.shape[0]]), cache)

    def forward_ragged(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                       logit_rows: torch.Tensor | None = None) -> ForwardOutput:
        """tokens [N]: the windows of `batch` back to back -> logits [N, V] (or [R, V] for the rows
        `logit_rows` [R] picks: the output layer is the largest weight a pass reads, so a caller that
        needs only some rows asks for those), routed ids [L, N, m].

        Everything but attention is per token, so it runs on all N at once (the MoE layer sees the
        whole pass: its union is the batch union). Attention: with the fused kernel one call per layer,
        each token at its own slot and position; without it one padded SDPA call per layer.
        """
        x, ids = self._layers(tokens, batch, cache, last_mlp=True)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        features = self.norm(x)
        return ForwardOutput(logits=self.output_logits(features), routed_ids=torch.stack(ids) if ids else None,
                             features=features)

    def fill_cache(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                   features: bool = False) -> torch.Tensor | None:
        """Prefill: write the keys and values of `tokens` to the cache and compute nothing else. No
        prompt row's logits are read (the last prompt token opens the first verify window), and the
        last layer's MLP feeds only those logits, so both are skipped: the same cache, less work.
        With `features`, the whole last layer runs and the normed final hidden states [N, H] are
        returned (a draft head reads them)."""
        x, _ = self._layers(tokens, batch, cache, last_mlp=features)
        return self.norm(x) if features else None

    def _layers(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                last_mlp: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over one pass -> final hidden states [N, H] (before the norm) and the
        routed ids [N, m] of each MoE layer that ran."""
        x = self.embed_tokens(tokens)  # [N, H]
        where = cos = sin = None
        # Fused attention at every pass size: on a 16 x 95-token prefill it took ~0.6 of the padded
        # SDPA path's time per layer (measured in-process, loaded machine).
        if self.fused_attention and x.is_cpu and not torch.is_grad_enabled():
            where = AttentionPass(batch.positions, batch.token_slot, cache.k, cache.v, self.rope_cos, self.rope_sin)
            pool = self.kernel_threads.attention(x.shape[0])
        else:
            cos, sin = self._rope(batch)
        ids = []
        for i, layer in enumerate(self.layers):
            if where is not None and not last_mlp and i == len(self.layers) - 1:
                # A prefill's last layer: only its keys and values are read later (its MLP is skipped below).
                self.kernels.attention_block(layer.self_attn.block, where, i, x, pool, kv_only=True)
                break
            if where is not None:  # norm, q/k/v, rope, cache write, attention, o_proj and the residual
                x = self.kernels.attention_block(layer.self_attn.block, where, i, x, pool)
            else:
                x = x + layer.self_attn.forward_ragged(layer.input_layernorm(x), cos, sin, cache, i, batch)
            if not last_mlp and i == len(self.layers) - 1:
                break
            h = layer.post_attention_layernorm(x)  # [N, H]
            if self.cfg.is_moe:
                h, _, routed = layer.mlp(h)
                ids.append(routed)
            else:
                h = layer.mlp(h)
            x = x + h
        return x, ids

    def _rope(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] at each token's position (eager attention)."""
        if batch.size == 1:  # contiguous positions: slices, not gathers
            first, last = batch.starts[0], batch.span
            return self.rope_cos[first:last, None], self.rope_sin[first:last, None]
        return self.rope_cos[batch.positions, None], self.rope_sin[batch.positions, None]

    def forward_train(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (logits [B, T, V], load-balancing loss); no cache."""
        features, balance = self.features_train(tokens)
        return self.lm_head(features), balance

    def features_train(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (final hidden states after the norm [B, T, H]: what the output layer and a
        draft head read, load-balancing loss); no cache."""
        B, T = tokens.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(tokens)  # [B, T, H]
        balance = x.new_zeros(())
        for layer in self.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
            h = layer.post_attention_layernorm(x).reshape(B * T, -1)
            if self.cfg.is_moe:
                h, logits, ids = layer.mlp(h)
                balance = balance + load_balancing_loss(logits, ids, self.cfg.num_experts)
            else:
                h = layer.mlp(h)
            x = x + h.view(B, T, -1)
        return self.norm(x), balance / max(1, len(self.layers))


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
