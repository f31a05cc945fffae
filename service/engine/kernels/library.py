"""The fused CPU kernels of the embedded engine: their ctypes wrappers, and `build`, which compiles
their C (csrc/) at first use.

The C, one library built from csrc/unity_kernels.c (its files and headers: csrc/__init__.py): the
shared helpers (common.c: `dot`, `exp512`, the register tiles of 4 positions x 64 output columns over
a weight packed in 64-column panels, `PackedWeight`: transposed, each panel contiguous, so there is no
horizontal sum per output, each weight streams in order and the positions that share a weight share
each loaded vector), the products, `rms_norm` and `linear` (matmul.c). Panels hold bf16 where every
value of the weight is one (the shipped checkpoint), widened exactly on load: the same results as
fp32 panels for half the bytes; or, for bf16 arithmetic (math="bf16"), bf16 pairs that VDPBF16PS
multiplies with the rows rounded to bf16 (bf16.c). A call may split its work over a `KernelPool`'s
threads (pool.py; `KernelThreads` says when), which changes no bit of the result.

`Kernels` wraps every entry point, with the checks that keep the C code's pointers in bounds:
`swiglu_experts(x, gate_up, down, ids, weights, out, accumulate)` and `moe_block(block, x)`, the MoE
kernels (contract in moe.py); `linear(x, weight)`, x [w, H] @ weight^T for a packed [V, H] weight
with the same row independence (the output layer); `attention_block(weights, pass, layer, x)`, a
layer's whole attention sub-block for the tokens of a ragged pass (attention.py);
`decoder_layers(stack, pass, x, last_mlp)`, every layer of a pass in one call, bitwise the per-layer
calls (decoder.py); `forward_logits(stack, head, pass, tokens, rows)`, a short pass from token ids to
logits and their argmax in one call, bitwise the separate calls (forward.py); `head_draft`, a draft
head's drafting chain (head.py).

`build` compiles the library with the system C compiler into a cache folder keyed by every C file
and header, the flags, the compiler and this CPU's feature flags, and loads it with ctypes only once
kernel_cache has checked the folder, the file and its recorded SHA-256 (c_build.py). Without a
compiler it returns None and callers keep the eager path.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from service.engine.kernels import c_build
from service.engine.kernels import head as head_kernel
from service.engine.kernels import pool as kernel_pool
from service.engine.kernels.attention import AttentionPass, AttentionWeights, CacheTables
from service.engine.kernels.decoder import DecoderStack
from service.engine.kernels.forward import OutputHead, StepSampling
from service.engine.kernels.moe import MoeBlock
from service.engine.kernels.packed import PackedWeight
from service.engine.kernels.pool import ONE_THREAD, KernelPool, KernelThreads
from service.types import SamplingParams

__all__ = ["AttentionPass", "AttentionWeights", "DecoderStack", "KernelThreads", "Kernels", "MoeBlock", "ONE_THREAD",
           "OutputHead", "PackedWeight", "build"]

log = logging.getLogger(__name__)


class Kernels:
    """The loaded library; one instance may be shared by every model of a process."""

    def __init__(self, library_path: Path):
        self.path = library_path
        lib = kernel_pool.load(library_path)
        self._lib = lib
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._swiglu = lib.swiglu_experts
        self._swiglu.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, i64, ptr, ptr, i64, ptr,
                                 ctypes.c_int]
        self._swiglu.restype = None
        self._linear = lib.linear
        self._linear.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr]
        self._linear.restype = None
        self._moe = lib.moe_block
        self._moe.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, ptr, i64, i64,
                              ptr, ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ptr]
        self._moe.restype = None
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
        self._rms_norm.restype = None
        self._attention = lib.attention_block
        self._attention.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ptr, i64, i64, i64, ctypes.c_int,
                                    ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
        self._attention.restype = None
        self._decoder = lib.decoder_layers
        self._decoder.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
                                  ptr, ptr, ptr]
        self._decoder.restype = ctypes.c_int
        self._forward = lib.forward_logits
        self._forward.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr,
                                  ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        self._forward.restype = ctypes.c_int
        self._decode_steps = lib.decode_steps
        self._decode_steps.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                                       ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        self._decode_steps.restype = ctypes.c_int64
        self._sample_rows = lib.sample_rows
        self._sample_rows.argtypes = [ptr, i64, i64, ctypes.c_float, i64, ctypes.c_float, ptr, ptr]
        self._sample_rows.restype = ctypes.c_int
        self._accept_drafts = lib.accept_drafts
        self._accept_drafts.argtypes = [ptr, i64, i64, ctypes.c_float, i64, ctypes.c_float, ptr, ptr, ptr, ptr, ptr]
        self._accept_drafts.restype = ctypes.c_int64
        self._head_draft = lib.head_draft
        self._head_draft.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr, ptr]
        self._head_draft.restype = ctypes.c_int
        self._head_steps = lib.head_greedy_steps
        self._head_steps.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                                     ptr, ptr, ptr]
        self._head_steps.restype = ctypes.c_int64
        self._head_tree = lib.head_tree
        self._head_tree.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
        self._head_tree.restype = ctypes.c_int64
        self.bf16_dot_native = bool(lib.bf16_dot_native())  # see `default_math`
        lib.bf16_dot_speedup.restype = ctypes.c_double
        self._bf16_dot_speedup = lib.bf16_dot_speedup
        # AMX tiles in the build and granted by the kernel (csrc/amx.c); asked once, when loaded
        self.amx_native = bool(lib.amx_enable())

    def swiglu_experts(self, x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, ids: torch.Tensor,
                       weights: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """See moe.py. gate_up: packed [E, 2I, H], down: packed [E, H, I]; x, out [w, H],
        ids [w, n] int64, weights [w, n], all contiguous; float32 throughout."""
        (E,), H, I = gate_up.lead, gate_up.in_features, down.in_features
        w, n = ids.shape
        # The C code trusts its pointers: check what would make it read or write out of bounds.
        if not (x.is_contiguous() and out.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
            raise ValueError("swiglu_experts: x, out, ids and weights must be contiguous")
        if gate_up.out_features != 2 * I or down.lead != (E,) or down.out_features != H:
            raise ValueError(f"swiglu_experts: gate_up must be [E, 2I, H] and down [E, H, I], got {gate_up} and {down}")
        if gate_up.format != down.format:
            raise ValueError(f"swiglu_experts: gate_up and down must share one panel format, got {gate_up} and {down}")
        if x.shape != (w, H) or out.shape != (w, H) or weights.shape != (w, n):
            raise ValueError("swiglu_experts: shapes disagree")
        if any(t.dtype != torch.float32 for t in (x, weights, out)) or ids.dtype != torch.int64:
            raise ValueError("swiglu_experts: float32 tensors and int64 ids only")
        if not all(t.is_cpu for t in (x, ids, weights, out)):
            raise ValueError("swiglu_experts: CPU tensors only")
        self._swiglu(x.data_ptr(), w, H, I, gate_up.data_ptr(), gate_up.stride, down.data_ptr(), down.stride,
                     gate_up.format, E, ids.data_ptr(), weights.data_ptr(), n, out.data_ptr(), int(accumulate))

    def moe_block(self, block: MoeBlock, x: torch.Tensor,
                  pool: KernelPool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [w, H] -> (out [w, H], router logits [w, E], routed ids [w, m]) of the block's layer: the
        router, softmax, top-k and both kinds of expert in one call (see the C source), its positions
        split over the pool's threads if one is given (bitwise the same result)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != block.H or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"moe_block: x must be a contiguous float32 CPU tensor [w, {block.H}]")
        w = x.shape[0]
        logits = x.new_empty(w, block.E + 1)
        ids = torch.empty(w, block.top_k, dtype=torch.long)
        weights = x.new_empty(w, block.top_k)
        out = torch.empty_like(x)
        scale = x.new_empty(w)  # each position's shared-expert scale (the kernel's scratch)
        a = block.args
        self._moe(x.data_ptr(), w, block.H, *a, logits.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                  out.data_ptr(), scale.data_ptr(), _handle(pool))
        return out, logits[:, :-1], ids

    def attention_block(self, weights: AttentionWeights, where: AttentionPass, layer: int,
                        x: torch.Tensor, pool: KernelPool | None = None, kv_only: bool = False) -> torch.Tensor | None:
        """x [N, H] (the residual stream) -> x + attention(rms_norm(x)) of one layer, writing the pass's
        keys and values into that layer's cache (see attention.py); its tokens split over the
        pool's threads if one is given (bitwise the same result). kv_only: write the keys and values
        (bitwise the same) and return None."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape != (where.n, weights.H) or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"attention_block: x must be a contiguous float32 CPU tensor [{where.n}, {weights.H}]")
        if (weights.K, weights.D) != (where.K, where.D):
            raise ValueError(f"attention_block: the cache holds {where.K} kv heads of {where.D}, the layer "
                             f"{weights.K} of {weights.D}")
        scratch = x.new_empty(weights.scratch_floats(where.n))
        out = torch.empty_like(x)
        self._attention(x.data_ptr(), where.n, weights.H, *weights.args, *where.args(layer), weights.o_ptr,
                        scratch.data_ptr(), out.data_ptr(), _handle(pool), int(kv_only))
        return None if kv_only else out

    def decoder_layers(self, stack: DecoderStack, where: AttentionPass, x: torch.Tensor, last_mlp: bool,
                       attention_pool: KernelPool | None = None, moe_pool: KernelPool | None = None,
                       overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, H] (the embedded tokens) -> (hidden states after every layer [N, H], routed ids
        [L, N, m]) in one call (see decoder.py), writing each layer's keys and values; the
        calls inside split over the pools' threads as the per-layer calls would. Without last_mlp (a
        prefill) the last layer only writes its keys and values: the states are then the last but
        one layer's and the ids [L - 1, N, m]. overwrite: the layers run in x itself (returned as the
        states) instead of a copy, for a caller that has no other use for it."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape != (where.n, stack.H) or not x.is_contiguous() \
                or not x.is_cpu:
            raise ValueError(f"decoder_layers: x must be a contiguous float32 CPU tensor [{where.n}, {stack.H}]")
        _check_cache("decoder_layers", stack, where)
        out = x if overwrite else x.clone()
        ids = torch.empty(stack.L, where.n, stack.m, dtype=torch.long)  # [L, N, 0] for a dense model
        rope_cos, rope_sin, positions, slots, parents, k_cache, v_cache, S = where.args(0)
        status = self._decoder(out.data_ptr(), where.n, stack.H, stack.L, ctypes.addressof(stack.array),
                               int(last_mlp), rope_cos, rope_sin, positions, slots, parents, k_cache, v_cache,
                               where.layer_floats, S, ids.data_ptr(), _handle(attention_pool), _handle(moe_pool))
        if status != 0:
            raise MemoryError("decoder_layers: out of memory")
        if not stack.moe:
            return out, None
        return out, ids if last_mlp else ids[:-1]

    def forward_logits(self, stack: DecoderStack, head: OutputHead, where: AttentionPass, tokens: torch.Tensor,
                       rows: torch.Tensor | None = None, attention_pool: KernelPool | None = None,
                       moe_pool: KernelPool | None = None, lm_pool: KernelPool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """tokens [N] (int64 ids) of a pass -> (features [R, H], logits [R, V], routed ids [L, N, m] or None
        for a dense model, argmax [R]) of the rows `rows` [R] (indices into the pass; None: all N), in one
        call (see forward.py), writing each layer's keys and values; bitwise the separate calls."""
        N = where.n
        if tokens.dtype != torch.int64 or tokens.shape != (N,) or not tokens.is_contiguous() or not tokens.is_cpu:
            raise ValueError(f"forward_logits: tokens must be a contiguous int64 CPU tensor [{N}]")
        if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous()
                                 or not rows.is_cpu):
            raise ValueError("forward_logits: rows must be a contiguous int64 CPU tensor [R]")
        _check_cache("forward_logits", stack, where)
        if head.H != stack.H:
            raise ValueError(f"forward_logits: the output head is {head.H} wide, the layers {stack.H}")
        R = N if rows is None else rows.shape[0]
        features, logits = torch.empty(R, stack.H), torch.empty(R, head.V)
        ids, argmax = torch.empty(stack.L, N, stack.m, dtype=torch.long), torch.empty(R, dtype=torch.long)
        rope_cos, rope_sin, positions, slots, parents, k_cache, v_cache, S = where.args(0)
        status = self._forward(tokens.data_ptr(), N, stack.H, stack.L, ctypes.addressof(stack.array),
                               ctypes.addressof(head), rope_cos, rope_sin, positions, slots, parents, k_cache, v_cache,
                               where.layer_floats, S, ids.data_ptr(), _handle(attention_pool), _handle(moe_pool),
                               _handle(lm_pool), None if rows is None else rows.data_ptr(), R, features.data_ptr(),
                               logits.data_ptr(), argmax.data_ptr())
        if status == 2:
            raise IndexError(f"forward_logits: a token id lies outside [0, {head.V})")
        if status == 3:
            raise IndexError(f"forward_logits: a logit row lies outside the pass's {N} tokens")
        if status != 0:
            raise MemoryError("forward_logits: out of memory")
        return features, logits, ids if stack.moe else None, argmax

    def sample_rows(self, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
        """logits [n, V] (float32, contiguous) -> tokens [n], row r drawn with uniforms[r] under params
        (temperature > 0, top-k, top-p; csrc/sampling.c): target_probs then sample's draw in one call."""
        n = logits.shape[0]
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous() or not logits.is_cpu:
            raise ValueError("sample_rows: logits must be a contiguous float32 CPU tensor [n, V]")
        if uniforms.dtype != torch.float32 or uniforms.shape != (n,) or not uniforms.is_contiguous():
            raise ValueError(f"sample_rows: uniforms must be a contiguous float32 tensor [{n}]")
        if params.greedy:
            raise ValueError("sample_rows: a greedy request takes the argmax, not a draw")
        tokens = torch.empty(n, dtype=torch.long)
        if self._sample_rows(logits.data_ptr(), n, logits.shape[1], params.temperature, params.top_k, params.top_p,
                             uniforms.data_ptr(), tokens.data_ptr()) != 0:
            raise MemoryError("sample_rows: out of memory")
        return tokens

    def accept_drafts(self, logits: torch.Tensor, params: SamplingParams, drafts: torch.Tensor, q: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[int, torch.Tensor, int]:
        """The verdict on k drafts of a sampled request (csrc/sampling.c; spec/sampling.py's `accept`):
        logits [k + 1, V] the target's rows of its window (float32, contiguous), drafts [k] int64, q [k, V]
        float32 what they were drawn from, uniforms [k + 1] float32 (the k tests', then the next token's)
        -> (drafts accepted, each draft's test [k] bool, the next token)."""
        k = drafts.shape[0]
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != k + 1 \
                or not logits.is_contiguous() or not logits.is_cpu:
            raise ValueError(f"accept_drafts: logits must be a contiguous float32 CPU tensor [{k + 1}, V]")
        V = logits.shape[1]
        if drafts.dtype != torch.int64 or not drafts.is_contiguous() or not bool(((drafts >= 0) & (drafts < V)).all()):
            raise ValueError(f"accept_drafts: drafts must be a contiguous int64 tensor of ids in [0, {V})")
        if q.dtype != torch.float32 or q.shape != (k, V) or not q.is_contiguous():
            raise ValueError(f"accept_drafts: q must be a contiguous float32 tensor [{k}, {V}]")
        if uniforms.dtype != torch.float32 or uniforms.shape != (k + 1,) or not uniforms.is_contiguous():
            raise ValueError(f"accept_drafts: uniforms must be a contiguous float32 tensor [{k + 1}]")
        if params.greedy:
            raise ValueError("accept_drafts: a greedy request's verdict is a prefix match, not a draw")
        accepted, token = torch.empty(k, dtype=torch.bool), torch.empty(1, dtype=torch.long)
        n = self._accept_drafts(logits.data_ptr(), k, V, params.temperature, params.top_k, params.top_p,
                                drafts.data_ptr(), q.data_ptr(), uniforms.data_ptr(), accepted.data_ptr(),
                                token.data_ptr())
        if n < 0:
            raise MemoryError("accept_drafts: out of memory")
        return n, accepted, int(token)

    def decode_steps(self, stack: DecoderStack, head: OutputHead, where: AttentionPass, tokens: torch.Tensor,
                     steps: int, eos: int | None, sampling: StepSampling | None = None,
                     attention_pool: KernelPool | None = None, moe_pool: KernelPool | None = None,
                     lm_pool: KernelPool | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[float]]:
        """Up to `steps` plain decode steps of the B sequences of a one-position pass (`where`: step 0's
        positions and slots; the caller has checked that positions + steps - 1 fit the cache) in one call,
        each step's picks its next tokens (see forward.py): a row's argmax, or its draw where `sampling`
        gives it a temperature above 0; stopping after a step that picks `eos` -> (picks [s, B], routed
        ids [s, L, B, m] or None for a dense model, each step's wall seconds [s]) of the s steps run.
        Every step's logits are bitwise the `forward_logits` pass's over the same tokens, and a draw is
        `sample_rows`'s with the same uniform."""
        B = where.n
        if tokens.dtype != torch.int64 or tokens.shape != (B,) or not tokens.is_contiguous() or not tokens.is_cpu:
            raise ValueError(f"decode_steps: tokens must be a contiguous int64 CPU tensor [{B}]")
        if steps < 1 or where.tensors[2] is not None:
            raise ValueError("decode_steps: steps must be >= 1, over a pass without draft trees")
        if sampling is not None and (sampling.B != B or steps > sampling.K):
            raise ValueError(f"decode_steps: sampling is for {sampling.B} rows and {sampling.K} steps, "
                             f"the call {B} rows and {steps} steps")
        _check_cache("decode_steps", stack, where)
        if head.H != stack.H:
            raise ValueError(f"decode_steps: the output head is {head.H} wide, the layers {stack.H}")
        per_step = stack.L * B * stack.m
        ids = torch.empty(steps, stack.L, B, stack.m, dtype=torch.long)
        picks, step_ns = torch.empty(steps, B, dtype=torch.long), torch.empty(steps, dtype=torch.long)
        rope_cos, rope_sin, positions, slots, _, k_cache, v_cache, S = where.args(0)
        done = self._decode_steps(tokens.data_ptr(), B, stack.H, stack.L, ctypes.addressof(stack.array),
                                  ctypes.addressof(head), rope_cos, rope_sin, positions, slots, k_cache, v_cache,
                                  where.layer_floats, S, steps, -1 if eos is None else eos,
                                  None if sampling is None else ctypes.addressof(sampling), per_step, ids.data_ptr(),
                                  picks.data_ptr(), step_ns.data_ptr(), _handle(attention_pool), _handle(moe_pool),
                                  _handle(lm_pool))
        if done == -2:
            raise IndexError(f"decode_steps: a token id lies outside [0, {head.V})")
        if done < 1:
            raise MemoryError("decode_steps: out of memory")
        return picks[:done], ids[:done] if stack.moe else None, [ns * 1e-9 for ns in step_ns[:done].tolist()]

    def head_greedy_steps(self, weights: head_kernel.HeadWeights, stack: DecoderStack, head: OutputHead,
                          tables: CacheTables, features: torch.Tensor, slot: int, ids: list[int], draft_valid: int,
                          k: int, budget: int, eos: int | None, steps: int, head_pool: KernelPool | None = None,
                          target_pool: KernelPool | None = None) -> head_kernel.HeadSteps:
        """Up to `steps` greedy speculative steps of one sequence (its committed `ids`, its head cache valid
        for the first `draft_valid`) in one call: each the head's catch-up and chain of min(k, budget - 1)
        drafts at temperature 0, one target pass over [last token, drafts] (its features written to
        `features` [slots, S, H], what the head reads), the greedy verdict and the commit (csrc/spec_steps.c),
        stopping after a step that commits `eos` or before a step that could draft nothing. Every step is
        bitwise what `head_draft`, `forward_logits` and the greedy verdict compute one call at a time."""
        n, H = len(ids), stack.H
        if features.dtype != torch.float32 or not features.is_contiguous() or tuple(features.shape) != (
                tables.slots, tables.S, H):
            raise ValueError(f"head_greedy_steps: features must be contiguous float32 [{tables.slots}, {tables.S}, "
                             f"{H}]")
        if not (1 <= draft_valid < n and k >= 1 and budget >= 1 and steps >= 1 and 0 <= slot < tables.slots):
            raise ValueError("head_greedy_steps: needs 1 <= draft_valid < len(ids), k, budget and steps >= 1, a slot "
                             "of the cache")
        if n + budget - 1 > min(tables.position_bound, weights.S):
            raise ValueError(f"head_greedy_steps: {n} tokens and a budget of {budget} do not fit the caches")
        _check_cache("head_greedy_steps", stack, tables)
        buffer = torch.tensor(ids + [0] * budget, dtype=torch.long)
        drafts, matches = torch.empty(steps, k, dtype=torch.long), torch.empty(steps, k, dtype=torch.long)
        window, accepted, bonus = (torch.empty(steps, dtype=torch.long) for _ in range(3))
        routed = torch.empty(steps, stack.L * (k + 1) * stack.m, dtype=torch.long)
        step_ns = torch.empty(steps, 2, dtype=torch.long)
        target = head_kernel.SpecTarget(ctypes.addressof(stack.array), ctypes.addressof(head), H, head.V, stack.L,
                                        stack.m, tables.S, tables.layer_floats, *tables.rope_ptrs, tables.k_ptr,
                                        tables.v_ptr, features.data_ptr())
        done = self._head_steps(ctypes.addressof(weights), ctypes.addressof(target), slot, buffer.data_ptr(), n,
                                draft_valid, k, budget, -1 if eos is None else eos, steps, drafts.data_ptr(),
                                window.data_ptr(), accepted.data_ptr(), matches.data_ptr(), bonus.data_ptr(),
                                routed.data_ptr(), step_ns.data_ptr(), _handle(head_pool), _handle(target_pool))
        if done < 0:
            raise MemoryError("head_greedy_steps: out of memory")
        widths = window[:done].tolist()
        return head_kernel.HeadSteps(
            drafts=[row[:w - 1] for row, w in zip(drafts[:done].tolist(), widths, strict=True)],
            matches=[tuple(bool(x) for x in row[:w - 1])
                     for row, w in zip(matches[:done].tolist(), widths, strict=True)],
            accepted=accepted[:done].tolist(), bonus=bonus[:done].tolist(),
            routed=[row[:stack.L * w * stack.m].view(stack.L, w, stack.m) for row, w in zip(routed[:done], widths,
                                                                                             strict=True)],
            seconds=[(a * 1e-9, b * 1e-9) for a, b in step_ns[:done].tolist()])

    def head_draft(self, weights: head_kernel.HeadWeights, tokens: torch.Tensor, features: torch.Tensor,
                   slot: int, start: int, k: int, temperature: float, uniforms: torch.Tensor | None,
                   pool: KernelPool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft head's catch-up over tokens [m] (target ids) with features [m, H] at positions
        start.. of `slot`, then its k picks (draft-vocabulary indices [k]), its products and attention
        split over the pool's threads if one is given (bitwise the same), and, when temperature > 0,
        the distributions they were drawn from [k, Vd]; see head.py."""
        Vd, m = weights.Vd, _check_catch_up("head_draft", weights, tokens, features)
        if k < 1 or start < 0 or start + m + k - 1 > weights.S or not 0 <= slot < weights.slots:
            raise ValueError(f"head_draft: {m} entries and {k} drafts from position {start} of slot {slot} do "
                             f"not fit the cache ({weights.slots} slots of {weights.S})")
        sampled = temperature > 0
        if sampled and (uniforms is None or uniforms.shape != (k,) or uniforms.dtype != torch.float32):
            raise ValueError(f"head_draft: a sampled draft needs float32 uniforms [{k}]")
        tokens, features = tokens.contiguous(), features.contiguous()
        picks = torch.empty(k, dtype=torch.long)
        q = features.new_empty(k, Vd) if sampled else None
        status = self._head_draft(ctypes.addressof(weights), m, tokens.data_ptr(), features.data_ptr(), slot, start, k,
                                  float(temperature), uniforms.data_ptr() if sampled else None, picks.data_ptr(),
                                  q.data_ptr() if sampled else None, _handle(pool))
        if status != 0:
            raise MemoryError("head_draft: out of memory")
        return picks, q

    def head_tree(self, weights: head_kernel.HeadWeights, tokens: torch.Tensor, features: torch.Tensor,
                  slot: int, start: int, budget: int, width: int, taus: torch.Tensor,
                  pool: KernelPool | None = None) -> tuple[list[int], list[int]]:
        """A draft head's catch-up over tokens [m] (target ids) with features [m, H] at positions start.. of
        `slot`, then its top-candidate tree of at most `budget` nodes of `width` candidates per expanded
        node, ranked at taus [budget] (depth d's temperature at d - 1) -> (draft-vocabulary indices [n],
        parents [n]: node indices, -1 the root), by depth; see head.py."""
        m = _check_catch_up("head_tree", weights, tokens, features)
        if budget < 1 or not 1 <= width <= 8 or start < 0 or start + m > weights.S or not 0 <= slot < weights.slots:
            raise ValueError(f"head_tree: {m} entries from position {start} of slot {slot} and a tree of {budget} "
                             f"nodes of width {width} (1..8) do not fit the cache ({weights.slots} slots of "
                             f"{weights.S})")
        if taus.shape != (budget,) or taus.dtype != torch.float32 or not bool((taus > 0).all()):
            raise ValueError(f"head_tree: taus must be float32 [{budget}], each > 0")
        tokens, features, taus = tokens.contiguous(), features.contiguous(), taus.contiguous()
        picks, parents = torch.empty(budget, dtype=torch.long), torch.empty(budget, dtype=torch.long)
        n = self._head_tree(ctypes.addressof(weights), m, tokens.data_ptr(), features.data_ptr(), slot, start, budget,
                            width, taus.data_ptr(), picks.data_ptr(), parents.data_ptr(), _handle(pool))
        if n < 0:
            raise MemoryError("head_tree: out of memory")
        return picks[:n].tolist(), parents[:n].tolist()

    def bf16_dot_speedup(self) -> float:
        """Products per second of this CPU's bf16 pair instruction (VDPBF16PS) over float32 FMAs', measured
        now on independent accumulators (csrc/bf16.c; a few milliseconds); 0 without the instruction."""
        return self._bf16_dot_speedup()

    def default_math(self) -> str:
        """The arithmetic of the matrix products where none is asked for: AMX where this CPU has the tile
        unit and the kernel grants it (the same bf16 inputs as bf16, the tile unit's float32 sums; a
        prefill, a batched step or a verify window runs several times faster, a one-position step as
        fast); else `choose_math` on this CPU's measured bf16 speed."""
        return choose_math(self.amx_native, self.bf16_dot_speedup() if self.bf16_dot_native else 0.0)

    def pool(self, threads: int) -> KernelPool:
        """Start `threads - 1` workers for this library's calls to split over (see pool.py)."""
        return KernelPool(self._lib, threads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2, -1) + eps) over the last dim of a contiguous float32 CPU x."""
        H = x.shape[-1]
        if x.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu or weight.shape != (H,) \
                or weight.dtype != torch.float32 or not weight.is_contiguous() or not weight.is_cpu:
            raise ValueError(f"rms_norm: x must be contiguous float32 [..., {H}] with a float32 weight [{H}]")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.numel() // H, H, weight.data_ptr(), eps, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, weight: PackedWeight, pool: KernelPool | None = None) -> torch.Tensor:
        """x [w, H] @ weight^T (a packed [V, H] weight) -> [w, V], float32, contiguous; each row of out
        is bitwise the same whatever else is in x (MKL's sgemm blocks differently by w); the output
        columns split over the pool's threads if one is given (bitwise the same result)."""
        H, V = weight.in_features, weight.out_features
        if weight.lead:
            raise ValueError(f"linear: weight must be one packed [V, H] matrix, got {weight}")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"linear: x must be contiguous float32 [w, {H}]")
        if not x.is_cpu:
            raise ValueError("linear: CPU tensors only")
        out = x.new_empty(x.shape[0], V)
        self._linear(x.data_ptr(), x.shape[0], H, weight.data_ptr(), weight.format, V, out.data_ptr(),
                     _handle(pool))
        return out


def _check_catch_up(kernel: str, weights: head_kernel.HeadWeights, tokens: torch.Tensor,
                    features: torch.Tensor) -> int:
    """A head kernel's catch-up entries: int64 token ids [m >= 1] in the target's vocabulary with float32
    features [m, H] -> m."""
    m, H = tokens.shape[0], weights.H
    if tokens.dtype != torch.int64 or tokens.dim() != 1 or m < 1 or features.shape != (m, H) \
            or features.dtype != torch.float32:
        raise ValueError(f"{kernel}: tokens must be int64 [m >= 1] and features float32 [m, {H}]")
    if int(tokens.min()) < 0 or int(tokens.max()) >= weights.V:
        raise ValueError(f"{kernel}: token ids must lie in [0, {weights.V})")
    return m


# bf16 arithmetic must multiply at least this much faster than float32 to be the default: it rounds every
# input (logits move ~0.003 on average from float32's, at most ~2% of their scale), which only pays for speed.
BF16_MIN_SPEEDUP = 1.25


def choose_math(amx: bool, bf16_speedup: float) -> str:
    """The default arithmetic from what the CPU offers: "amx" with the tile unit; "bf16" where its bf16
    pair instruction computes products at least BF16_MIN_SPEEDUP times as fast as float32 FMAs (AMD Zen 4:
    ~2x; prefill and batched steps then run ~1.3-1.5x faster); else "fp32", the exact arithmetic (on a
    2-core Intel Xeon without AMX the instruction ran at ~0.5x the FMAs' rate: bf16 was slower at one and
    at 16 clients)."""
    if amx:
        return "amx"
    return "bf16" if bf16_speedup >= BF16_MIN_SPEEDUP else "fp32"


def _check_cache(kernel: str, stack: DecoderStack, where: AttentionPass | CacheTables) -> None:
    """The pass's cache has the stack's layers, kv heads and head dim (the C code trusts it)."""
    if (where.layers, where.K, where.D) != (stack.L, *stack.kv):
        raise ValueError(f"{kernel}: the cache holds {where.layers} layers of {where.K} kv heads of {where.D}, the "
                         f"model {stack.L} of {stack.kv[0]} of {stack.kv[1]}")


def _handle(pool: KernelPool | None) -> int | None:
    return None if pool is None else pool.handle


def build(cache_dir: Path | None = None, compiler: str | None = None,
          extra_flags: tuple[str, ...] = ()) -> Kernels | None:
    """Compile (or reuse) the library and load it; None, with one warning, when it cannot be built.

    cache_dir defaults to ~/.cache/moespec/kernels, compiler to `cc` on the PATH; extra_flags go after
    the default flags (tests build the portable code with c_build.PORTABLE_FLAGS).
    """
    try:
        return c_build.build_library("unity_kernels.c", Kernels, cache_dir, compiler, extra_flags)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the fused kernels (%s): the eager path runs", e)
        return None
