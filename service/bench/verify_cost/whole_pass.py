"""The whole verify pass of a geometry on the embedded engine's own code path (`--context C`): the
engine's `Transformer` (embedding, every decoder layer's attention at a cache of C positions and MoE
block, final norm, output layer, per-row argmax, in the one kernel call a short pass makes), between
`RaggedBatch.build` and the greedy verdict, which the engine's verify pass also runs. Random weights,
the routing steered as in fused_cpu.py.

How the routing is steered through a whole model: position p of the window carries token p, whose
embedding row holds 1 at column p of the first `WINDOW_MAX` columns (0 at the others of them, random
small values beyond). Every write into the residual stream leaves those columns alone (the output rows
< WINDOW_MAX of each attention's o_proj and each expert's down projection are zero), so at every layer
the MoE block's input at position p is a positive multiple (its RMS norm) of e_p on those columns, and a
`SteeredBlock` router (zero past them) picks exactly the asked experts, as with the unit-vector inputs of
the MoE-blocks measurement. The run checks the routed ids every point.

The model is built with placeholder experts (as many as top-k, 32 wide) and each layer's MoE block then
replaced by a `SteeredBlock` of the geometry's size drawn directly in the packed layout, so the float32
copies of the experts are never made. Attention is the engine's (grouped-query, rope, biases on q/k/v):
geometries whose attention differs (MLA, a head dim other than hidden / heads, q/k norms) are refused
or approximated as `whole_pass_refusal` says."""

from __future__ import annotations

import torch

from service.bench.verify_cost.fused_cpu import WINDOW_MAX, SteeredBlock, panel_format_for
from service.bench.verify_cost.geometry import Geometry
from service.engine.kernels.decoder import DecoderStack
from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.library import Kernels
from service.engine.kernels.pool import ONE_THREAD, KernelThreads
from service.engine.model.config import ModelConfig
from service.engine.model.layers import RMSNorm
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.transformer import Transformer
from service.engine.spec.sampling import accept_greedy_ids

PLACEHOLDER_WIDTH = 32  # the placeholder experts' width (one AMX tile deep): replaced before any pass


def whole_pass_refusal(g: Geometry) -> str | None:
    """Why the engine's model cannot run this geometry's whole pass, or None when it can."""
    if not g.has_attention:
        return f"geometry {g.name!r} has no attention part the engine runs (MLA or unknown heads)"
    if g.heads * g.head_dim != g.hidden:
        return (f"geometry {g.name!r}: {g.heads} heads x {g.head_dim} = {g.heads * g.head_dim} is not the hidden "
                f"size {g.hidden}; the engine's attention has head dim = hidden / heads")
    if g.vocab < WINDOW_MAX:
        return f"geometry {g.name!r}: no vocabulary size known (vocab_size), needed for the output layer"
    return None


def model_config(g: Geometry, context: int) -> ModelConfig:
    """The engine's config for the geometry's whole model, with placeholder experts."""
    return ModelConfig(model_type="qwen2_moe", vocab_size=g.vocab, hidden_size=g.hidden, num_hidden_layers=g.layers,
                       num_attention_heads=g.heads, num_key_value_heads=g.kv_heads,
                       intermediate_size=PLACEHOLDER_WIDTH, max_position_embeddings=context + WINDOW_MAX,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       num_experts=g.top_k, num_experts_per_tok=g.top_k, moe_intermediate_size=PLACEHOLDER_WIDTH,
                       shared_expert_intermediate_size=PLACEHOLDER_WIDTH)


def whole_pass_bytes(g: Geometry) -> int:
    """What the measurement holds: every layer's experts and attention in bf16 panels, the attention's
    float32 copies, the embedding and output layer in float32 and packed."""
    attention = g.hidden * g.head_dim * (2 * g.heads + 2 * g.kv_heads)
    return g.layers * (2 * g.layer_params(attention=False) + 4 * attention) + g.vocab * g.hidden * (4 + 4 + 2)


class WholePassModel:
    """`run()` is one verify pass of the prepared window as the engine's ModelRunner.verify times it."""

    device = "cpu"
    routes_itself = True

    def __init__(self, kernels: Kernels, g: Geometry, math: str, threads: int, context: int, seed: int = 0):
        reason = whole_pass_refusal(g)
        if reason is not None:
            raise ValueError(reason)
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.geometry, self.math, self.context, self.n_layers = g, math, context, g.layers
        cfg = model_config(g, context)
        generator = torch.Generator().manual_seed(seed)
        model = Transformer(cfg).eval().requires_grad_(False)
        self._randomize(model, generator)
        pool = kernels.pool(threads) if threads > 1 else None
        model.fuse_for_inference(kernels, kernel_threads=KernelThreads(pool) if pool else ONE_THREAD, math=math)
        fmt, arena = panel_format_for(math, g), PanelArena()
        for layer in model.layers:
            layer.mlp.block = SteeredBlock(g, fmt, generator, arena, quiet_rows=WINDOW_MAX)
        model.decoder_stack = DecoderStack(model.layers, moe=True)  # the stack reads the steered blocks
        self.model, self.pool = model, pool
        self.cache = KVCache(cfg, context + WINDOW_MAX)
        # The context: C positions of other tokens in the cache (their keys and values are what attention reads).
        prompt = WINDOW_MAX + torch.arange(context) % (g.vocab - WINDOW_MAX)
        with torch.inference_mode():  # the fused path, as the engine runs it
            model.fill_cache(prompt, RaggedBatch.build([0], [0], [context]), self.cache)
        self.window_ids: torch.Tensor | None = None

    @staticmethod
    def _randomize(model: Transformer, generator: torch.Generator) -> None:
        """Random bf16-valued weights (the engine's are bf16 values), norms at 1, and the steering columns:
        token p's embedding is e_p there, and nothing writes to them."""
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)
            p.copy_(p.bfloat16().float())
        for norm in model.modules():
            if isinstance(norm, RMSNorm):  # a positive scale keeps the steering columns' top-k
                norm.weight.fill_(1.0)
        embed = model.embed_tokens.weight
        embed[:, :WINDOW_MAX] = 0.0
        embed[:WINDOW_MAX, :WINDOW_MAX] = torch.eye(WINDOW_MAX)
        for layer in model.layers:
            layer.self_attn.o_proj.weight[:WINDOW_MAX] = 0.0

    def prepare(self, ids: torch.Tensor) -> None:
        """ids [L, w, k]: steer every layer's router (outside the timed part)."""
        for layer, layer_ids in zip(self.model.layers, ids, strict=True):
            layer.mlp.block.steer(layer_ids)
        self.window_ids = ids

    def run(self) -> torch.Tensor:
        """One pass: the batch, the forward from token ids to each row's argmax, the greedy verdict of the
        window's drafts -> the routed ids [L, w, k]. Call it in inference mode, as the engine's scheduler
        runs its passes (measure.py does)."""
        w = self.window_ids.shape[1]
        window = list(range(w))  # position p carries token p (see the module's docstring)
        batch = RaggedBatch.build([0], [self.context], [w], tokens=window)
        out = self.model.forward_ragged(batch.tokens, batch, self.cache)
        accept_greedy_ids(window[1:], out.argmax.tolist())
        return out.routed_ids

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
