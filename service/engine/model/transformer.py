"""The Qwen2 / Qwen2-MoE decoder (`Transformer`) for inference with a static KV cache.

Contract:
- `weights.py` builds it from and saves it to the per-expert hub layout that transformers and
  SGLang load; its layers are in `layers.py`, its batches and caches in `ragged.py`, and what only
  training runs (the cache-free forward, the load-balancing loss, initialisation) in
  `training.py`.
- `forward(tokens, start)` runs a window of w consecutive positions starting at `start`, writes
  their keys/values into the static cache at those positions and attends to everything before.
  `forward_ragged(tokens, batch)` does the same for the windows of several sequences in one pass
  (continuous batching), each in its own cache slot (`RaggedBatch`, `KVCache`).
- Each MoE layer reports the routed top-m expert ids of every position in the window, so the
  caller can count the distinct experts a verification pass touched (the union).
- `fuse_for_inference(kernels)` selects the fast step: on CPU, every pass runs each layer's attention
  sub-block in one kernel call (kernels/attention.py: no padding, no mask, every token at its own slot
  and position; prefill passes too), passes of up to kernel_window_max positions the MoE block too
  (the whole layer loop is then one call, kernels/decoder.py; for the dense draft up to 16 positions),
  windows of up to UNION_WINDOW_MAX the MLPs and the output layer too (kernels/library.py), and a
  `forward_ragged` of those passes runs from token ids to logits and their argmax in one call
  (kernels/forward.py); in all of them each position's result does not depend on the rest of its pass;
  `math="bf16"` (or "amx", on the AMX tile unit) runs their matrix products in bf16 arithmetic
  (kernels/packed.py), still row by row. Without kernels, the eager step.

Shape legend: w window positions, N tokens of a ragged pass, B sequences in it, R logit rows,
H hidden, L layers, m experts per token, V vocabulary, S cache length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.kernels.attention import AttentionPass, CacheTables
from service.engine.kernels.decoder import DecoderStack
from service.engine.kernels.forward import OutputHead, StepSampling
from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.library import Kernels
from service.engine.kernels.packed import PackedWeight, panel_format
from service.engine.kernels.pool import ONE_THREAD, KernelThreads
from service.engine.model.config import ModelConfig
from service.engine.model.layers import KERNEL_WINDOW_MAX, UNION_WINDOW_MAX, DecoderLayer, RMSNorm
from service.engine.model.ragged import KVCache, RaggedBatch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [w, V]
    routed_ids: torch.Tensor | None  # [L, w, m] for MoE models
    features: torch.Tensor | None = None  # [w, H] final hidden states after the norm (what a draft head reads)
    # [N, n*H] the residual stream after each captured layer, concatenated (what an EAGLE-3 draft reads)
    aux: torch.Tensor | None = None
    argmax: torch.Tensor | None = None  # [w] each logit row's first maximum, where the one-call pass computed it


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
        self.decoder_stack: DecoderStack | None = None  # see fuse_for_inference
        self.decoder_stack_max = 0
        self.output_head: OutputHead | None = None  # see fuse_for_inference
        self._cache_tables: CacheTables | None = None  # the last cache a pass ran over, checked (see _pass_over)

    def fuse_for_inference(self, kernels: Kernels | None = None, kernel_window_max: int = KERNEL_WINDOW_MAX,
                           fused_attention: bool = True, kernel_threads: KernelThreads = ONE_THREAD,
                           math: str = "fp32") -> None:
        """Concatenate projections that read the same input, for fewer matmuls per step; with kernels
        (kernels.build()), also the fast step: passes up to `kernel_window_max` positions run each
        layer's attention sub-block (unless `fused_attention` is False: attention then runs as one
        padded SDPA call per layer beside the other kernels, kept to measure against) and MoE block in
        one kernel call each, the output layer too, short windows the MLPs, every norm its own call;
        `kernel_threads` says when a call splits its positions over threads. Without kernels, the
        eager step.

        The fused tensors are copies: call after the weights are final (training never fuses).
        """
        # The kernels' weights in 2 MB pages where the system offers them (kernels/hugepages.py).
        arena = PanelArena() if kernels is not None else None
        for layer in self.layers:
            layer.self_attn.fuse(layer.input_layernorm if kernels is not None and fused_attention else None, math,
                                 arena)
            if self.cfg.is_moe:
                layer.mlp.fuse(kernels, kernel_window_max, kernel_threads, math, arena)
            else:
                layer.mlp.use_kernels(kernels, arena)
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.kernels = kernels
        self.kernels = kernels
        self.lm_head_packed = None if kernels is None else PackedWeight.pack(
            self.lm_head.weight, panel_format(math, self.lm_head.weight), arena)
        self.kernel_window_max = kernel_window_max
        self.kernel_threads = kernel_threads
        self.fused_attention = kernels is not None and fused_attention
        # Every layer's attention and MLP fused: the whole layer loop is one call (kernels/decoder.py), for
        # the passes the per-layer MLP would run in its kernel (MoE: kernel_window_max, dense: 16 positions).
        self.decoder_stack = DecoderStack(self.layers, self.cfg.is_moe) if self.fused_attention else None
        self.decoder_stack_max = kernel_window_max if self.cfg.is_moe else UNION_WINDOW_MAX
        # ...and those passes from token ids to logits in one call (kernels/forward.py).
        self.output_head = None if self.decoder_stack is None else OutputHead.of(
            self.embed_tokens.weight.detach(), self.norm.weight.detach(), self.norm.eps, self.lm_head_packed)

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
                       logit_rows: torch.Tensor | None = None, capture: tuple[int, ...] = ()) -> ForwardOutput:
        """tokens [N]: the windows of `batch` back to back -> logits [N, V] (or [R, V] for the rows
        `logit_rows` [R] picks: the output layer is the largest weight a pass reads, so a caller that
        needs only some rows asks for those), routed ids [L, N, m].

        Everything but attention is per token, so it runs on all N at once (the MoE layer sees the
        whole pass: its union is the batch union). Attention: with the fused kernel one call per layer,
        each token at its own slot and position; without it one padded SDPA call per layer.

        `capture`: layer ids whose outputs (the residual stream after the layer, pre-norm) come back in
        `aux` [N, len(capture) * H], for every token of the pass. Without it nothing else changes.
        """
        rows = tokens.shape[0] if logit_rows is None else logit_rows.shape[0]
        if self.output_head is not None and self.decoder_stack is not None and not capture \
                and tokens.shape[0] <= self.decoder_stack_max \
                and rows <= self.kernel_window_max and tokens.is_cpu and not torch.is_grad_enabled():
            return self._forward_in_one_call(tokens, batch, cache, logit_rows, rows)
        x, routed, aux = self._layers(tokens, batch, cache, last_mlp=True, capture=capture)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        features = self.norm(x)
        return ForwardOutput(logits=self.output_logits(features), routed_ids=routed, features=features, aux=aux)

    def _forward_in_one_call(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                             logit_rows: torch.Tensor | None, rows: int) -> ForwardOutput:
        """forward_ragged as one kernel call (kernels/forward.py): bitwise the per-part path below."""
        where = self._pass_over(batch, cache)
        n, threads = tokens.shape[0], self.kernel_threads
        features, logits, routed, argmax = self.kernels.forward_logits(
            self.decoder_stack, self.output_head, where, tokens.contiguous(), logit_rows, threads.attention(n),
            threads.moe(n), threads.linear(rows))
        return ForwardOutput(logits=logits, routed_ids=routed, features=features, argmax=argmax)

    def runs_in_one_call(self, positions: int) -> bool:
        """Whether a pass of this many positions takes the one-call path that `decode_steps` (one
        position per sequence) and `head_greedy_steps` (a verify window) run step after step."""
        return (self.output_head is not None and self.decoder_stack is not None
                and positions <= min(self.decoder_stack_max, self.kernel_window_max) and not torch.is_grad_enabled())

    def decode_steps(self, batch: RaggedBatch, cache: KVCache, steps: int, eos: int | None,
                     sampling: StepSampling | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[float]]:
        """Up to `steps` plain decode steps of the sequences of `batch` (one position each, its tokens the
        steps' first; `runs_in_one_call(batch.size)`) back to back in one kernel call, each step's picks
        (the argmax, or a draw for the rows `sampling` samples) the next step's tokens, ending after a step
        whose picks hold `eos` -> (picks [s, B], routed ids [s, L, B, m], each step's seconds [s]). Each
        step is bitwise the `forward_ragged` pass over the same tokens, so the picks are what `steps`
        plain steps would commit."""
        low, high = batch.position_range
        where = AttentionPass.over(self._tables_for(cache), batch.positions, batch.token_slot,
                                   (low, high + steps - 1), batch.slot_range)  # every step's positions checked
        n, threads = batch.size, self.kernel_threads
        return self.kernels.decode_steps(self.decoder_stack, self.output_head, where, batch.tokens, steps, eos,
                                         sampling, threads.attention(n), threads.moe(n), threads.linear(n))

    def head_greedy_steps(self, head_weights, head_pool, cache: KVCache, features: torch.Tensor, slot: int,
                          ids: list[int], draft_valid: int, k: int, budget: int, eos: int | None, steps: int):
        """Up to `steps` greedy speculative steps of one sequence with a draft head (`head_weights`, the
        head's C chain) in one kernel call, this model verifying (`Kernels.head_greedy_steps`; its
        `features` [slots, S, H] get each verified position's final features) -> `HeadSteps`."""
        return self.kernels.head_greedy_steps(head_weights, self.decoder_stack, self.output_head,
                                              self._tables_for(cache), features, slot, ids, draft_valid, k, budget,
                                              eos, steps, head_pool, self.kernel_threads.pool)

    def fill_cache(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                   features: bool = False, capture: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Prefill: write the keys and values of `tokens` to the cache and compute nothing else. No
        prompt row's logits are read (the last prompt token opens the first verify window), and the
        last layer's MLP feeds only those logits, so both are skipped: the same cache, less work.
        With `features`, the whole last layer runs and the normed final hidden states [N, H] are
        returned (a draft head reads them). With `capture` (layer ids), the captured layers' outputs
        [N, len(capture) * H] are returned instead (an EAGLE-3 draft reads them; see forward_ragged)."""
        x, _, aux = self._layers(tokens, batch, cache, last_mlp=features, capture=capture)
        if capture:
            return aux
        return self.norm(x) if features else None

    def _layers(self, tokens: torch.Tensor, batch: RaggedBatch, cache: KVCache, last_mlp: bool,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The decoder layers over one pass -> final hidden states [N, H] (before the norm), the
        routed ids [L', N, m] of the MoE layers that ran (None for a dense model) and the outputs of
        the layers in `capture` concatenated [N, n*H] (None without). A capture runs the per-layer
        loop (the same kernels, one call per layer) instead of the whole-stack call, which hands
        back only the last layer; a pass without one takes exactly the path it took before."""
        if capture and (max(capture) >= len(self.layers) - (0 if last_mlp else 1) or min(capture) < 0):
            raise ValueError(f"capture layers {list(capture)} outside the {len(self.layers)} layers this pass runs")
        # [N, H]; the function, not the module: a module call's hooks machinery cost more than the lookup
        # of a decode step's one row.
        x = F.embedding(tokens, self.embed_tokens.weight)
        where = cos = sin = None
        # Fused attention at every pass size: on a 16 x 95-token prefill it took ~0.6 of the padded
        # SDPA path's time per layer (measured in-process, loaded machine).
        if self.fused_attention and x.is_cpu and not torch.is_grad_enabled():
            where = self._pass_over(batch, cache)
            pool = self.kernel_threads.attention(x.shape[0])
            if self.decoder_stack is not None and x.shape[0] <= self.decoder_stack_max and not capture:
                return (*self.kernels.decoder_layers(self.decoder_stack, where, x, last_mlp, pool,
                                                     self.kernel_threads.moe(x.shape[0]), overwrite=True), None)
        elif batch.tree is not None:
            raise ValueError("a pass with draft trees needs the fused attention kernel (the eager step runs chains)")
        else:
            cos, sin = self._rope(batch)
        ids, captured = [], []
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
            if i in capture:
                captured.append(x.clone())  # a later in-place kernel may reuse x's storage
        return x, torch.stack(ids) if ids else None, torch.cat(captured, dim=-1) if captured else None

    def _pass_over(self, batch: RaggedBatch, cache: KVCache) -> AttentionPass:
        """The fused attention's view of one pass over `cache`; the cache and rope tables are checked
        once per cache (a model usually runs over one), the pass's positions and slots every time."""
        return AttentionPass.over(self._tables_for(cache), batch.positions, batch.token_slot, batch.position_range,
                                  batch.slot_range, batch.tree)

    def _tables_for(self, cache: KVCache) -> CacheTables:
        """The fused attention's checked view of `cache` (checked once per cache: a model usually runs over one)."""
        tables = self._cache_tables
        if tables is None or not tables.reads(cache.k, cache.v):
            tables = self._cache_tables = CacheTables(cache.k, cache.v, self.rope_cos, self.rope_sin)
        return tables

    def _rope(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] at each token's position (eager attention)."""
        if batch.size == 1:  # contiguous positions: slices, not gathers
            first, last = batch.starts[0], batch.span
            return self.rope_cos[first:last, None], self.rope_sin[first:last, None]
        return self.rope_cos[batch.positions, None], self.rope_sin[batch.positions, None]
