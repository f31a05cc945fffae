"""The attention sub-block of one decoder layer in one C call, for the tokens of a ragged pass.

Why: after the MoE block moved into one kernel call, attention was half of a decode step (~1.3-1.5 ms
of ~2.9 ms CPU on the shipped model): q/k/v, rope (cat, mul), the cache write, the mask, SDPA, the
transposes and o_proj are ~20 small torch ops per layer, each a few microseconds of dispatch for a
few microseconds of arithmetic. Here the whole sub-block is one call per layer and needs no padding,
no mask tensor and no gathers: every token carries its own cache slot and absolute position.

Contract of `attention_block` (csrc/attention.c, compiled into library.py's library; it uses `dot`,
`exp512`, `matmul_p` and `rms_norm` from csrc/common.c and matmul.c):
- x [N, H]: the tokens of one pass (any mix of windows of any sequences); token t sits at position
  positions[t] of cache slot slots[t]. For each token:
  h = rms_norm(x[t]) * norm_w; [q | k | v] = W_qkv h + b_qkv (A query heads, K kv heads of D);
  q and k rotated by rope at that position (tables [max positions, D], the model's own buffers);
  k and v written to the cache at (slot, position); query head a attends with kv head a / (A / K)
  to its slot's keys 0..position, softmax in fp32 with scale 1/sqrt(D);
  out[t] = x[t] + W_o [heads concatenated].
- Every token's keys and values are written before any token attends, so a window sees its own
  earlier positions; entries past a token's position (a rejected draft's) are never read.
- Draft trees (`tree`, else every window is a chain): every token writes its key and value at its own
  position (a tree's nodes take distinct rows); a node's path runs from its window's first token, at
  row b, through its ancestors to itself, d + 1 rows; it is roped at b + d and attends the prefix rows
  0..b-1, then its path's rows as keys b..b+d: exactly what decoding its path as a chain would read, in
  the same order, so its output is bitwise that chain's. Ancestors may be tokens of the same pass or
  rows written by an earlier one (a drafter's tree grows a depth per pass). `tree` holds N offsets,
  then per token [d, b, r1, .., rd] (ragged.py's `encode_paths`).
- Each token's row is computed on its own in a fixed order of operations: bitwise the same alone or
  inside any pass (what keeps greedy speculation == plain decoding exact).
- The C code trusts its pointers: `AttentionWeights` checks a layer's weights once, `AttentionPass`
  checks a pass's positions and slots against the cache and the rope tables once for all layers.

Shape legend: N tokens of a pass, H hidden, A query heads, K kv heads, D head dim, R = (A + 2K) D,
S cache length per slot.
"""

from __future__ import annotations

import torch

from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.packed import PackedWeight, panel_format


class AttentionWeights:
    """One layer's attention weights for `Kernels.attention_block`, checked once (the kernel keeps
    pointers to them: they must not move or be replaced afterwards)."""

    def __init__(self, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor,
                 o_weight: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, bf16: bool | None = None,
                 math: str = "fp32", arena: PanelArena | None = None):
        """norm_weight [H]; qkv_weight [(A + 2K) D, H] (q rows, then k, then v), qkv_bias [(A + 2K) D];
        o_weight [H, A D]. Contiguous float32 CPU. math: the projections' arithmetic (`panel_format`;
        the attention itself stays float32); bf16: force bf16 (True) or float32 (False) panels for
        math="fp32"."""
        H = norm_weight.shape[0]
        if n_kv < 1 or n_heads % n_kv or head_dim % 2:
            raise ValueError(f"attention_block: {n_heads} heads over {n_kv} kv heads of dim {head_dim}: need "
                             "whole groups and an even head dim")
        R = (n_heads + 2 * n_kv) * head_dim
        expected = {"norm_weight": (H,), "qkv_weight": (R, H), "qkv_bias": (R,), "o_weight": (H, n_heads * head_dim)}
        given = dict(norm_weight=norm_weight, qkv_weight=qkv_weight, qkv_bias=qkv_bias, o_weight=o_weight)
        for name, t in given.items():
            if tuple(t.shape) != expected[name] or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"attention_block: {name} must be a contiguous float32 CPU tensor {expected[name]}")
        self.H, self.A, self.K, self.D, self.R = H, n_heads, n_kv, head_dim, R
        # Packed copies for matmul_p (which streams each weight panel in order); they and the tensors
        # given stay referenced while the pointers below are in use.
        # One format for both packed projections (one kernel flag), see panel_format.
        self.format = panel_format(math, qkv_weight, o_weight, bf16=bf16)
        qkv_p, o_p = PackedWeight.pack(qkv_weight, self.format, arena), PackedWeight.pack(o_weight, self.format, arena)
        self.tensors = dict(given, qkv_p=qkv_p, o_p=o_p)
        self.args = (norm_weight.data_ptr(), float(eps), qkv_p.data_ptr(), qkv_bias.data_ptr(), n_heads, n_kv,
                     head_dim, self.format)
        self.o_ptr = o_p.data_ptr()

    def scratch_floats(self, n: int) -> int:
        return n * (self.H + self.R + self.A * self.D)


class CacheTables:
    """A KV cache and the rope tables every pass over it reads, checked once: a cache's tensors are
    written in place and never replaced, so a model checks them on first use and each pass then checks
    only its own positions and slots (`AttentionPass.over`; a decode step's checks cost more than its
    kernel call's Python)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        """k_cache, v_cache [L, slots, K, S, D] float32; rope_cos, rope_sin [max positions, D] float32; all
        contiguous CPU tensors."""
        for name, t in dict(k_cache=k_cache, v_cache=v_cache, rope_cos=rope_cos, rope_sin=rope_sin).items():
            if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"attention_block: {name} must be a contiguous float32 CPU tensor")
        if k_cache.dim() != 5 or v_cache.shape != k_cache.shape:
            raise ValueError("attention_block: k_cache and v_cache must both be [L, slots, K, S, D]")
        self.layers, self.slots, self.K, self.S, self.D = k_cache.shape
        if rope_cos.dim() != 2 or rope_cos.shape[1] != self.D or rope_sin.shape != rope_cos.shape:
            raise ValueError(f"attention_block: rope tables must be [positions, {self.D}]")
        self.position_bound = min(self.S, rope_cos.shape[0])
        self.tensors = (k_cache, v_cache, rope_cos, rope_sin)  # alive while in use
        self.layer_floats = k_cache.stride(0)
        self.layer_bytes = self.layer_floats * k_cache.element_size()
        self.k_ptr, self.v_ptr = k_cache.data_ptr(), v_cache.data_ptr()
        self.rope_ptrs = (rope_cos.data_ptr(), rope_sin.data_ptr())

    def reads(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """These tables were checked for this cache's very tensors."""
        return self.tensors[0] is k_cache and self.tensors[1] is v_cache


class AttentionPass:
    """Where the N tokens of one pass go (position and cache slot of each) and the tensors every
    layer's call shares, checked once per pass: the kernel writes and reads there unchecked."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rope_cos: torch.Tensor, rope_sin: torch.Tensor, position_range: tuple[int, int] | None = None,
                 slot_range: tuple[int, int] | None = None, tree: torch.Tensor | None = None):
        """positions, slots [N] int64 contiguous CPU tensors; the cache and rope tables as `CacheTables`
        takes them. position_range / slot_range: the lowest and highest of positions / slots where the
        caller knows them (a RaggedBatch does; four reductions saved a step), else read from the tensors.
        tree: the pass's draft-tree paths (see the module's contract), or None."""
        self._check(positions, slots, CacheTables(k_cache, v_cache, rope_cos, rope_sin), position_range, slot_range,
                    tree)

    @classmethod
    def over(cls, tables: CacheTables, positions: torch.Tensor, slots: torch.Tensor,
             position_range: tuple[int, int] | None = None, slot_range: tuple[int, int] | None = None,
             tree: torch.Tensor | None = None) -> AttentionPass:
        """A pass over tables checked before: only its positions, slots and tree are checked."""
        where = cls.__new__(cls)
        where._check(positions, slots, tables, position_range, slot_range, tree)
        return where

    def _check(self, positions: torch.Tensor, slots: torch.Tensor, tables: CacheTables,
               position_range: tuple[int, int] | None, slot_range: tuple[int, int] | None,
               tree: torch.Tensor | None = None) -> None:
        if positions.dtype != torch.int64 or slots.dtype != torch.int64 or positions.dim() != 1 \
                or positions.shape != slots.shape or not (positions.is_contiguous() and slots.is_contiguous()):
            raise ValueError("attention_block: positions and slots must be contiguous int64 [N]")
        self.n = positions.numel()
        if self.n:
            low, high = position_range or (int(positions.min()), int(positions.max()))
            if low < 0 or high >= tables.position_bound:
                raise ValueError(f"attention_block: positions must lie in [0, {tables.position_bound})")
            low, high = slot_range or (int(slots.min()), int(slots.max()))
            if low < 0 or high >= tables.slots:
                raise ValueError(f"attention_block: cache slots must lie in [0, {tables.slots})")
        self.layers, self.K, self.S, self.D = tables.layers, tables.K, tables.S, tables.D
        if tree is not None:
            _check_tree(tree, positions, tables.position_bound)
        self.tables, self.tensors = tables, (positions, slots, tree)  # alive while in use
        self.layer_floats = tables.layer_floats
        self._shared = (*tables.rope_ptrs, positions.data_ptr(), slots.data_ptr(),
                        None if tree is None else tree.data_ptr())

    def args(self, layer: int) -> tuple:
        """The kernel's rope, position, slot, parent and cache arguments for one layer."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"attention_block: layer {layer} outside the cache's {self.layers}")
        offset = layer * self.tables.layer_bytes
        return (*self._shared, self.tables.k_ptr + offset, self.tables.v_ptr + offset, self.S)


def _check_tree(tree: torch.Tensor, positions: torch.Tensor, bound: int) -> None:
    """What the kernel trusts of a pass's tree paths: each token's record lies in the tensor, its rows
    and its rope position (first row + depth) lie in the cache, and its path ends at its own position."""
    if tree.dtype != torch.int64 or tree.dim() != 1 or not tree.is_contiguous() or not tree.is_cpu:
        raise ValueError("attention_block: tree must be a contiguous int64 CPU tensor")
    values, n = tree.tolist(), positions.numel()
    for t, position in enumerate(positions.tolist()):
        at = values[t] if t < len(values) else -1
        if not n <= at < len(values) or not 0 <= values[at] < len(values) - at - 1:
            raise ValueError(f"attention_block: token {t}'s tree record lies outside the tree tensor")
        depth, path = values[at], values[at + 1:at + 2 + values[at]]
        if path[-1] != position or min(path) < 0 or max(path) >= bound or path[0] + depth >= bound:
            raise ValueError(f"attention_block: token {t}'s tree path {path} must end at its position {position} "
                             f"and lie in [0, {bound})")
