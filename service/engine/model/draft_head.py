"""The draft head: one decoder layer that drafts from the target's own hidden state (EAGLE-style).

Why: a separate draft model must re-derive from the tokens what the target already knows; on the
shipped pair a 2-layer dense draft cost ~0.65 of a target step per drafted token, so speculation
with it never paid. The head reads the target's final hidden state instead, so one small layer
suffices, and it predicts over a reduced vocabulary (the most frequent tokens of the training
corpus, mapped back to the target's ids, as EAGLE-3 does), so its output layer is a quarter of the
target's.

Contract:
- Entry p of the head's sequence takes (f[p-1], token[p]): f the target's normed final hidden state
  at position p-1 (zeros at p = 0), token[p] embedded with the target's own embedding table. It
  returns a feature fhat[p] (an estimate of f[p]) and logits over the draft vocabulary for token
  p + 1. Drafting chains: the next entry takes (fhat[p], the token drafted from those logits).
- The head keeps its own KV cache (one layer) like any decoder: entries of committed tokens are
  (re)computed from the target's true features after every verify pass, so a rejected draft's entry
  is overwritten and never read.
- `vocab` [Vd] maps draft index -> target token id; a token outside it has draft probability 0,
  which the lossless acceptance rule handles like any other q.

Shape legend: B sequences, T training positions, N tokens of a ragged pass, H hidden, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from service.engine.kernels.attention import AttentionPass
from service.engine.kernels.head import HeadWeights
from service.engine.kernels.hugepages import PanelArena
from service.engine.kernels.library import Kernels
from service.engine.kernels.packed import PackedWeight, panel_format
from service.engine.kernels.pool import ONE_THREAD, KernelThreads
from service.engine.model.config import ModelConfig
from service.engine.model.layers import DecoderLayer, RMSNorm, apply_rope
from service.engine.model.ragged import KVCache, RaggedBatch

HEAD_MODEL_TYPE = "moespec_draft_head"


def head_config(target: ModelConfig, draft_vocab: int, intermediate: int) -> ModelConfig:
    """The head's decoder-layer config: the target's attention shape, a dense MLP, the draft vocabulary."""
    return dataclasses.replace(target, model_type=HEAD_MODEL_TYPE, vocab_size=draft_vocab, num_hidden_layers=1,
                               intermediate_size=intermediate, num_experts=0, num_experts_per_tok=0,
                               moe_intermediate_size=0, shared_expert_intermediate_size=0,
                               tie_word_embeddings=False)


def is_head_dir(directory: Path) -> bool:
    config = Path(directory) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == HEAD_MODEL_TYPE


class DraftHead(nn.Module):
    def __init__(self, cfg: ModelConfig, target_vocab: int):
        super().__init__()
        H = cfg.hidden_size
        self.cfg, self.target_vocab = cfg, target_vocab
        self.embed_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.feature_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.register_buffer("vocab", torch.arange(cfg.vocab_size), persistent=True)  # [Vd] target ids
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [S, D]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.kernels: Kernels | None = None
        self.kernel_threads = ONE_THREAD
        self.fc_packed: PackedWeight | None = None
        self.lm_head_packed: PackedWeight | None = None

    # ------------------------------------------------------------------ inference
    def fuse_for_inference(self, kernels: Kernels | None, kernel_threads: KernelThreads = ONE_THREAD) -> None:
        """The fast step's kernels for every part (copies of the weights: call once they are final)."""
        arena = PanelArena() if kernels is not None else None  # 2 MB pages where offered (kernels/hugepages.py)
        attn = self.layer.self_attn
        attn.fuse(self.layer.input_layernorm if kernels is not None else None, arena=arena)
        self.layer.mlp.use_kernels(kernels, arena)
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.kernels = kernels
        self.kernels, self.kernel_threads = kernels, kernel_threads
        if kernels is not None:
            self.fc_packed = PackedWeight.pack(self.fc.weight, panel_format("fp32", self.fc.weight), arena)
            self.lm_head_packed = PackedWeight.pack(self.lm_head.weight, panel_format("fp32", self.lm_head.weight),
                                                    arena)

    def _linear(self, x: torch.Tensor, packed: PackedWeight | None, layer: nn.Linear) -> torch.Tensor:
        if packed is not None and not torch.is_grad_enabled():  # rows independent at any count (sgemm's are not)
            return self.kernels.linear(x.contiguous(), packed, self.kernel_threads.linear(x.shape[0]))
        return layer(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layer.mlp
        if mlp.kernels is None or torch.is_grad_enabled():
            return mlp(x)
        out = torch.empty_like(x)  # the kernel at every row count: each row on its own, like the chain's
        ones = torch.ones(x.shape[0], 1)
        mlp.kernels.swiglu_experts(x.contiguous(), *mlp.kernel_weights, torch.zeros(x.shape[0], 1, dtype=torch.long),
                                   ones, out, accumulate=False)
        return out

    def forward_ragged(self, embedded: torch.Tensor, features: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                       logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [N, H] (target embeddings of the tokens), features [N, H] (the feature each entry
        takes) -> (logits [R, Vd] at `logit_rows`, fhat [R, H] there)."""
        x = self._linear(torch.cat([self.embed_norm(embedded), self.feature_norm(features)], dim=-1),
                         self.fc_packed, self.fc)
        x = self._attention(x, batch, cache)
        x = x.index_select(0, logit_rows)
        x = x + self._mlp(self.layer.post_attention_layernorm(x))
        return self._linear(self.norm(x), self.lm_head_packed, self.lm_head), x

    def chain_weights(self, embed: torch.Tensor, cache: KVCache) -> HeadWeights | None:
        """The C chain's view of this head, the target's embedding table [V, H] and the head's cache
        (None without kernels). The tensors must stay alive and in place while it is used."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        if self.kernels is None or attn.block is None:
            return None
        block, cfg = attn.block, self.cfg
        gate_up, down = mlp.kernel_weights
        return HeadWeights(H=cfg.hidden_size, I=cfg.intermediate_size, Vd=cfg.vocab_size, A=block.A, K=block.K,
                           D=block.D, S=cache.max_len, V=embed.shape[0], slots=cache.slots, eps=cfg.rms_norm_eps,
                           embed=embed.data_ptr(),
                           embed_norm_w=self.embed_norm.weight.data_ptr(),
                           feature_norm_w=self.feature_norm.weight.data_ptr(),
                           attn_norm_w=self.layer.input_layernorm.weight.data_ptr(),
                           post_norm_w=self.layer.post_attention_layernorm.weight.data_ptr(),
                           final_norm_w=self.norm.weight.data_ptr(), fc_wt=self.fc_packed.data_ptr(),
                           fc_fmt=self.fc_packed.format, qkv_wt=block.args[2], qkv_b=block.args[3], o_wt=block.o_ptr,
                           attn_fmt=block.format, gate_up_t=gate_up.data_ptr(), down_t=down.data_ptr(),
                           mlp_fmt=gate_up.format, lm_wt=self.lm_head_packed.data_ptr(),
                           lm_fmt=self.lm_head_packed.format, vocab=self.vocab.data_ptr(),
                           rope_cos=self.rope_cos.data_ptr(), rope_sin=self.rope_sin.data_ptr(),
                           k_cache=cache.k.data_ptr(), v_cache=cache.v.data_ptr())

    def _attention(self, x: torch.Tensor, batch: RaggedBatch, cache: KVCache) -> torch.Tensor:
        attn = self.layer.self_attn
        if attn.block is not None and x.is_cpu and not torch.is_grad_enabled():
            where = AttentionPass(batch.positions, batch.token_slot, cache.k, cache.v, self.rope_cos, self.rope_sin,
                                  batch.position_range, batch.slot_range, batch.tree)
            return self.kernels.attention_block(attn.block, where, 0, x, self.kernel_threads.attention(x.shape[0]))
        if batch.tree is not None:
            raise ValueError("a pass with draft trees needs the fused attention kernel (the eager step runs chains)")
        if batch.size == 1:
            first, last = batch.starts[0], batch.span
            cos, sin = self.rope_cos[first:last, None], self.rope_sin[first:last, None]
        else:
            cos, sin = self.rope_cos[batch.positions, None], self.rope_sin[batch.positions, None]
        return x + attn.forward_ragged(self.layer.input_layernorm(x), cos, sin, cache, 0, batch)

    # ------------------------------------------------------------------ training
    def forward_train(self, embedded: torch.Tensor, features: torch.Tensor,
                      steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """embedded [B, T, H] (target embeddings of tokens 0..T-1), features [B, T, H] (the target's
        normed final hidden states at 0..T-1) -> per unrolled step s = 1..steps: (logits [B, T, Vd],
        fhat [B, T, H]), entry p's outputs predicting token p + 1 / feature p.

        Step 1 is teacher-forced: entry p takes f[p-1]. Step s > 1 is what drafting the s-th token of
        a chain sees ("training-time test"): entry p takes fhat from step s-1 at p-1, attends to the
        true entries up to p-s+1 and to the chain's own entries p-s+2..p from steps 2..s.
        """
        B, T, H = embedded.shape
        attn = self.layer.self_attn
        A, K, D = attn.n_heads, attn.n_kv, attn.head_dim
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        embedded = self.embed_norm(embedded)
        shifted = F.pad(features[:, :-1], (0, 0, 1, 0))  # [B, T, H]: entry p takes f[p-1]
        keys, values, outs = [], [], []
        position = torch.arange(T)
        for s in range(1, steps + 1):
            x = self.fc(torch.cat([embedded, self.feature_norm(shifted)], dim=-1))  # [B, T, H]
            q, k, v = attn._project(self.layer.input_layernorm(x))
            q = apply_rope(q.view(B, T, A, D).transpose(1, 2), cos, sin)  # [B, A, T, D]
            keys.append(apply_rope(k.view(B, T, K, D).transpose(1, 2), cos, sin))  # [B, K, T, D]
            values.append(v.view(B, T, K, D).transpose(1, 2))
            # Row p sees block 1 (true entries) at columns <= p-s+1 and block j >= 2 at column p-s+j.
            blocks = [position[None, :] <= (position[:, None] - s + 1)]
            blocks += [position[None, :] == (position[:, None] - s + j) for j in range(2, s + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, s*T]
            mask[:, 0] |= ~mask.any(1)  # rows with no key yet (p < s-1) see entry 0: no NaN, masked in the loss
            out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                 enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, A * D))
            x = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
            outs.append((self.lm_head(self.norm(x)), x))
            shifted = F.pad(x[:, :-1], (0, 0, 1, 0))
        return outs


def save_head(head: DraftHead, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v if k == "vocab" else v.detach().to(dtype)).clone() for k, v in head.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {**dataclasses.asdict(head.cfg), "target_vocab_size": head.target_vocab}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_head(directory: Path, kernels: Kernels | None = None, kernel_threads: KernelThreads = ONE_THREAD,
              for_inference: bool = True) -> DraftHead:
    """Raises FileNotFoundError / ValueError naming what is wrong with the directory."""
    directory = Path(directory)
    for required in ("config.json", "model.safetensors"):
        if not (directory / required).is_file():
            raise FileNotFoundError(f"draft head directory {directory} has no {required}")
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type") != HEAD_MODEL_TYPE:
        raise ValueError(f"{directory}: model_type {raw.get('model_type')!r} is not {HEAD_MODEL_TYPE}")
    head = DraftHead(ModelConfig.from_json(directory / "config.json"), int(raw["target_vocab_size"]))
    state = {k: v if k == "vocab" else v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    head.eval().requires_grad_(False)
    if for_inference:
        head.fuse_for_inference(kernels, kernel_threads)
    return head
