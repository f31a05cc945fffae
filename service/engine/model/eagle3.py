"""The EAGLE-3 draft: one decoder layer over the target's aux hidden states, in SGLang's
`LlamaForCausalLMEagle3` checkpoint format, so one shipped checkpoint drafts on both backends.

Definition (SGLang 0.5.23, srt/models/llama_eagle3.py, read as the reference):
- The target hands over, per position p, its residual stream after each decoder layer listed in
  `eagle_config.eagle_aux_hidden_state_layer_ids` (layer i's *output*, pre-norm; SGLang captures it
  as the input of layer i + 1, so every id must be below the target's last layer), concatenated in
  ascending layer order: aux[p] [3 Ht].
- Entry p of the draft's sequence sits at position p and takes (hidden, token[p + 1]): hidden is
  fc(aux[p]) for an entry of a verified position, or the draft's own output hidden of the previous
  chain entry (already H wide: fc is skipped). It predicts token[p + 2] over the draft vocabulary.
- The one layer ("midlayer"): residual = hidden; the attention reads
  cat(input_layernorm(embed(token)), hidden_norm(hidden)) [2H] (q/k/v project 2H, no bias);
  residual += o_proj(attention); residual += mlp(post_attention_layernorm(residual)); logits =
  lm_head(norm(residual)); the output hidden the next chain entry takes is `residual`, pre-norm.
- No embedding of its own: the target's table (SGLang's `set_embed`).
- `d2t` [Vd] int64: target id of draft index i is i + d2t[i]; `t2d` [V] bool: which target ids the
  draft vocabulary holds (SGLang ignores it; the EAGLE-3 reference writes it).

Checkpoint names (what SGLang's loader maps: "midlayer" -> "model.layers.0", q/k/v -> qkv_proj,
gate/up -> gate_up_proj, others under "model." unless top-level like lm_head): fc.weight,
midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, d2t, t2d.

Shape legend: B rows, T training positions, N tokens of a ragged pass, R rows read out, H hidden,
Ht the target's hidden, Vd draft vocabulary, V the target's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from service.engine.model.config import ModelConfig
from service.engine.model.layers import MLP, Attention, RMSNorm, apply_rope
from service.engine.model.ragged import KVCache, RaggedBatch

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # under config.json's "eagle_config"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's: the shared embedding table's rows
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def decoder_config(self) -> ModelConfig:
        """The shape the shared layer classes (attention, MLP, KV cache) take."""
        return ModelConfig(model_type="llama", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, intermediate_size=self.intermediate_size,
                           max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
                           rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=False, eos_token_id=self.eos_token_id)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, intermediate_size: int,
                   aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
        ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(target.num_hidden_layers)
        check_aux_layer_ids(ids, target.num_hidden_layers)
        return cls(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, intermediate_size=intermediate_size,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size, aux_layer_ids=ids, target_hidden_size=target.hidden_size,
                   eos_token_id=target.eos_token_id)

    def to_hf_dict(self) -> dict:
        """config.json as SGLang's LlamaForCausalLMEagle3 (a transformers LlamaConfig) reads it."""
        return {
            "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "eos_token_id": self.eos_token_id, "torch_dtype": "bfloat16",
            "eagle_config": {AUX_LAYER_IDS_KEY: list(self.aux_layer_ids), "use_aux_hidden_state": True},
        }

    @classmethod
    def from_hf_dict(cls, raw: dict, where: str = "config.json") -> Eagle3Config:
        if EAGLE3_ARCHITECTURE not in (raw.get("architectures") or []):
            raise ValueError(f"{where}: architectures {raw.get('architectures')!r} do not name {EAGLE3_ARCHITECTURE}")
        ids = (raw.get("eagle_config") or {}).get(AUX_LAYER_IDS_KEY)
        if not ids:
            raise ValueError(f"{where}: no eagle_config.{AUX_LAYER_IDS_KEY} (the target layers the draft reads)")
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "vocab_size", "draft_vocab_size"):
            if raw.get(key) is None:
                raise ValueError(f"{where}: no {key}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{where}: num_hidden_layers {raw['num_hidden_layers']}: the EAGLE-3 draft here has one")
        theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
                   num_key_value_heads=raw["num_key_value_heads"], intermediate_size=raw["intermediate_size"],
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                   max_position_embeddings=raw.get("max_position_embeddings", 2048), vocab_size=raw["vocab_size"],
                   draft_vocab_size=raw["draft_vocab_size"], aux_layer_ids=tuple(ids),
                   target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
                   eos_token_id=raw.get("eos_token_id"))


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high layer whose outputs the draft reads. SGLang's own default when the
    config names none ([2, L // 2, L - 3] as *inputs*) collapses on a 4-layer target, so the shipped
    checkpoint always names its ids; these are the outputs of layers 0, L // 2 - 1 and L - 2."""
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 draft needs a target with at least 3 layers, not {num_layers}")
    return (0, num_layers // 2 - 1, num_layers - 2) if num_layers >= 4 else (0, 1, 1)


def check_aux_layer_ids(ids: tuple[int, ...], num_layers: int) -> None:
    """SGLang captures layer i's output as layer i + 1's input: i must be below the last layer, and
    its capture order is the layers' order, so the ids must ascend without repeats."""
    if len(ids) == 0 or any(i < 0 or i > num_layers - 2 for i in ids):
        raise ValueError(f"aux layer ids {list(ids)} must lie in 0..{num_layers - 2} for a {num_layers}-layer target")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"aux layer ids {list(ids)} must ascend without repeats (SGLang captures in layer order)")


class Eagle3Attention(Attention):
    """The midlayer's attention: q, k and v project the 2H input cat(embeds, hidden), no bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        A, K, D, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * H, A * D, bias=False)
        self.k_proj = nn.Linear(2 * H, K * D, bias=False)
        self.v_proj = nn.Linear(2 * H, K * D, bias=False)


class Eagle3Midlayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the hidden states
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        layer_cfg = cfg.decoder_config()
        self.layer_cfg = layer_cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(layer_cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        D = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2).float() / D))
        angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [S, D]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    # ------------------------------------------------------------------ vocabulary
    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """target_ids [Vd] ascending: the target id of each draft index -> d2t and t2d."""
        if target_ids.shape != (self.cfg.draft_vocab_size,):
            raise ValueError(f"draft vocabulary has {target_ids.numel()} ids, the config says "
                             f"{self.cfg.draft_vocab_size}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """[Vd]: the target id of each draft index (SGLang's hot_token_id)."""
        return self.d2t + torch.arange(self.d2t.numel())

    # ------------------------------------------------------------------ forward
    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3 Ht] (the target's captured layers) -> hidden [..., H]."""
        return self.fc(aux)

    def _attention_input(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(hidden)], dim=-1)

    def _finish(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual after attention -> (draft logits, the output hidden: pre-norm residual)."""
        layer = self.midlayer
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.lm_head(self.norm(residual)), residual

    def forward_ragged(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: RaggedBatch, cache: KVCache,
                       logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [N, H] (the target's embeddings of each entry's token), hidden [N, H] (fc(aux) or
        a previous entry's output) -> (draft logits [R, Vd], output hidden [R, H]) at `logit_rows`.
        Entry positions are `batch.positions`; its keys and values go to `cache` layer 0."""
        if batch.size == 1:
            first = batch.starts[0]
            cos, sin = self.rope_cos[first:batch.span, None], self.rope_sin[first:batch.span, None]
        else:
            cos, sin = self.rope_cos[batch.positions, None], self.rope_sin[batch.positions, None]
        x = self._attention_input(embedded, hidden)
        residual = hidden + self.midlayer.self_attn.forward_ragged(x, cos, sin, cache, 0, batch)
        return self._finish(residual.index_select(0, logit_rows))

    def forward_node(self, embedded: torch.Tensor, hidden: torch.Tensor, cache: KVCache, slot: int, row: int,
                     position: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-tree node's entry: embedded [H] (its token's target embedding), hidden [H] (its
        parent's output) -> (draft logits [Vd], output hidden [H]). Its keys and values go to cache row
        `row` of `slot` (layer 0), roped at `position`; it attends the slot's `rows` [S'] only (the true
        entries, then its path's node rows down to its own), so a node reads what a chain along its
        path would have read, and nothing of its siblings."""
        attn = self.midlayer.self_attn
        A, K, D = attn.n_heads, attn.n_kv, attn.head_dim
        q, k, v = attn._project(self._attention_input(embedded[None], hidden[None]))
        cos, sin = self.rope_cos[position:position + 1, None], self.rope_sin[position:position + 1, None]
        cache.k[0][slot, :, row] = apply_rope(k.view(1, K, D), cos, sin)[0]
        cache.v[0][slot, :, row] = v.view(K, D)
        keys, values = cache.k[0][slot][:, rows], cache.v[0][slot][:, rows]  # [K, S', D]
        q = apply_rope(q.view(1, A, D), cos, sin).transpose(0, 1)  # [A, 1, D]
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], enable_gqa=True)  # [1, A, 1, D]
        logits, out_hidden = self._finish(hidden[None] + attn.o_proj(out.reshape(1, A * D)))
        return logits[0], out_hidden[0]

    def forward_train(self, embedded: torch.Tensor, aux: torch.Tensor,
                      steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """embedded [B, T, H] (target embeddings of tokens 1..T), aux [B, T, 3Ht] (the target's aux
        at positions 0..T-1) -> per unrolled step s = 1..steps: (draft logits [B, T, Vd], output
        hidden [B, T, H]); entry p predicts token p + 2 at every step.

        Step 1 is teacher-forced: entry p takes fc(aux[p]). Step s > 1 is what the s-th drafted
        token of a chain sees (EAGLE-3's training-time test): entry p takes step s-1's output at
        p-1, attends to the true entries up to p-s+1 and to the chain's own entries p-s+2..p of
        steps 2..s (their keys sit at those positions, as in drafting).
        """
        B, T, H = embedded.shape
        attn = self.midlayer.self_attn
        A, K, D = attn.n_heads, attn.n_kv, attn.head_dim
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        hidden = self.fc(aux)
        keys, values, outs = [], [], []
        position = torch.arange(T)
        for s in range(1, steps + 1):
            q, k, v = attn._project(self._attention_input(embedded, hidden))
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
            residual = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, A * D))
            logits, out_hidden = self._finish(residual)
            outs.append((logits, out_hidden))
            hidden = F.pad(out_hidden[:, :-1], (0, 0, 1, 0))  # entry p of step s+1 takes entry p-1's output
        return outs

    def new_cache(self, max_len: int, slots: int = 1) -> KVCache:
        return KVCache(self.layer_cfg, max_len, slots)


def checkpoint_state(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint under SGLang's names (d2t int64 and t2d bool kept as they are)."""
    return {k: (v if k in ("d2t", "t2d") else v.detach().to(dtype)).clone().contiguous()
            for k, v in draft.state_dict().items()}


def save_eagle3(draft: Eagle3Draft, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state(draft, dtype), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(draft.cfg.to_hf_dict(), indent=2) + "\n")


def is_eagle3_dir(directory: Path) -> bool:
    config = Path(directory) / "config.json"
    return config.is_file() and EAGLE3_ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])


def load_eagle3(directory: Path) -> Eagle3Draft:
    """Raises FileNotFoundError / ValueError naming what is wrong with the directory."""
    directory = Path(directory)
    for required in ("config.json", "model.safetensors"):
        if not (directory / required).is_file():
            raise FileNotFoundError(f"EAGLE-3 draft directory {directory} has no {required}")
    cfg = Eagle3Config.from_hf_dict(json.loads((directory / "config.json").read_text()),
                                    str(directory / "config.json"))
    draft = Eagle3Draft(cfg)
    tensors = load_file(str(directory / "model.safetensors"))
    state = {k: v if k in ("d2t", "t2d") else v.float() for k, v in tensors.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return draft.eval().requires_grad_(False)
