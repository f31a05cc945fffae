"""The EAGLE-3 draft: its checkpoint is SGLang's LlamaForCausalLMEagle3 format (names, shapes,
config keys), its forward is SGLang's definition (checked against a plain torch re-implementation
of srt/models/llama_eagle3.py written here), d2t maps draft indices to target ids as SGLang reads
it, the target's capture hands over transformers' hidden states of the named layers, and a pass
without a capture is bitwise what it was."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from service.engine.kernels import library as kernels
from service.engine.model.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    check_aux_layer_ids,
    load_eagle3,
    save_eagle3,
)
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference, load_model

TEXT = "import os\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"

# What SGLang 0.5.23's LlamaForCausalLMEagle3.load_weights maps onto its parameters ("midlayer" ->
# model.layers.0, q/k/v -> qkv_proj, gate/up -> gate_up_proj, d2t read as hot ids, t2d skipped).
SGLANG_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def target():
    return load_model(DEFAULT_TARGET_DIR)


def random_draft(target, seed: int = 0, draft_vocab: int = 96) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.for_target(target.cfg, draft_vocab, 128))
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05) + (1.0 if p.dim() == 1 else 0.0))
    vocab = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    draft.set_vocabulary(vocab.sort().values)
    return draft.eval().requires_grad_(False)


def test_checkpoint_has_sglang_names_shapes_and_config(target, tmp_path):
    draft = random_draft(target)
    save_eagle3(draft, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == SGLANG_NAMES
    H, A, K, D, I, Vd, V = 256, 4, 2, 64, 128, 96, target.cfg.vocab_size
    shapes = {"fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (A * D, 2 * H),
              "midlayer.self_attn.k_proj.weight": (K * D, 2 * H), "midlayer.self_attn.v_proj.weight": (K * D, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, A * D), "midlayer.mlp.gate_proj.weight": (I, H),
              "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
              "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,), "norm.weight": (H,)}
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == Vd and config["vocab_size"] == V and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["tie_word_embeddings"] is False  # else SGLang would use the embedding as lm_head
    loaded = load_eagle3(tmp_path)
    for name, value in draft.state_dict().items():
        expected = value if name in ("d2t", "t2d") else value.to(torch.bfloat16).float()
        assert torch.equal(loaded.state_dict()[name], expected), name


def test_d2t_maps_draft_indices_to_target_ids_as_sglang_reads_it(target):
    draft = random_draft(target, seed=3)
    vocab = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(3))[:96].sort().values
    hot_token_id = draft.d2t + torch.arange(96)  # SGLang: hot_token_id = d2t + arange(draft vocab)
    assert torch.equal(hot_token_id, vocab) and torch.equal(draft.target_ids, vocab)
    assert int(draft.t2d.sum()) == 96 and bool(draft.t2d[vocab].all())
    with pytest.raises(ValueError, match="draft vocabulary has 5 ids"):
        draft.set_vocabulary(vocab[:5])


def test_bad_configs_are_named(tmp_path, target):
    save_eagle3(random_draft(target), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3(tmp_path)
    with pytest.raises(ValueError, match="must lie in 0..2"):
        check_aux_layer_ids((0, 1, 3), 4)  # layer 3's output has no next layer to capture it at
    with pytest.raises(ValueError, match="ascend"):
        check_aux_layer_ids((2, 1), 4)


# ------------------------------------------------------------------ SGLang's definition, in plain torch
def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=10000.0):
    """Neox-style rotary embedding (SGLang's get_rope default for Llama): x [N, heads, D]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    ang = positions[:, None].float() * inv[None]  # [N, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SglangEagle3Reference:
    """LlamaModel + LlamaDecoderLayer(layer 0) of srt/models/llama_eagle3.py over one sequence, with
    its keys and values kept per position: forward(embeds, hidden, positions) -> (logits, aux)."""

    def __init__(self, state: dict, heads: int = 4, kv_heads: int = 2):
        self.w, self.A, self.K = state, heads, kv_heads
        self.keys, self.values, self.positions = [], [], []

    def forward(self, embeds, hidden, positions):
        w, A, K = self.w, self.A, self.K
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = hidden @ w["fc.weight"].T  # the target's aux [3H] -> H
        residual = hidden
        x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]),
                       rms(hidden, w["midlayer.hidden_norm.weight"])], dim=-1)
        N, D = x.shape[0], 64
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(N, A, D), positions)
        k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(N, K, D), positions)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(N, K, D)
        self.keys.append(k)
        self.values.append(v)
        self.positions.append(positions)
        keys, values, kpos = torch.cat(self.keys), torch.cat(self.values), torch.cat(self.positions)
        out = []
        for i in range(N):
            seen = kpos <= positions[i]
            per_head = []
            for h in range(A):
                kh, vh = keys[seen, h // (A // K)], values[seen, h // (A // K)]
                scores = (q[i, h] @ kh.T) / D ** 0.5
                per_head.append(scores.softmax(-1) @ vh)
            out.append(torch.cat(per_head))
        attn = torch.stack(out) @ w["midlayer.self_attn.o_proj.weight"].T
        residual = residual + attn
        h = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        g, u = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        residual = residual + (torch.nn.functional.silu(g) * u) @ w["midlayer.mlp.down_proj.weight"].T
        return rms(residual, w["norm.weight"]) @ w["lm_head.weight"].T, residual  # aux: pre-norm (norm_output off)


def test_forward_matches_sglangs_definition_through_extend_and_chain(target):
    draft = random_draft(target, seed=1)
    ref = SglangEagle3Reference({k: v.float() for k, v in draft.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    n, H = 12, 256
    embeds, aux = torch.randn(n, H, generator=g), torch.randn(n, 3 * H, generator=g) * 3
    cache = KVCache(draft.layer_cfg, 32)
    with torch.no_grad():
        # Draft extend over n verified entries (positions 0..n-1), every row read out.
        got, got_aux = draft.forward_ragged(embeds, draft.project_aux(aux), RaggedBatch.build([0], [0], [n]), cache,
                                            torch.arange(n))
        want, want_aux = ref.forward(embeds, aux, torch.arange(n))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_aux, want_aux, atol=1e-4, rtol=1e-4)
        # Two chain steps: each reads the previous entry's output hidden (H wide: no fc).
        hidden = got_aux[-1:]
        for step in range(2):
            e = torch.randn(1, H, generator=g)
            got, hidden_got = draft.forward_ragged(e, hidden, RaggedBatch.build([0], [n + step], [1]), cache,
                                                   torch.zeros(1, dtype=torch.long))
            want, hidden_want = ref.forward(e, hidden, torch.tensor([n + step]))
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden_got, hidden_want, atol=1e-4, rtol=1e-4)
            hidden = hidden_got
        # Training's step 1 is the same forward, teacher-forced.
        logits_train = draft.forward_train(embeds[None], aux[None], 1)[0][0][0]
        ref2 = SglangEagle3Reference({k: v.float() for k, v in draft.state_dict().items()})
        torch.testing.assert_close(logits_train, ref2.forward(embeds, aux, torch.arange(n))[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ the target's capture
@pytest.fixture(scope="module")
def fast_target():
    built = kernels.build()
    assert built is not None, "the kernels did not build"
    return load_for_inference(DEFAULT_TARGET_DIR, kernels=built)


@pytest.mark.parametrize("which", ["eager", "fast"])
def test_capture_is_transformers_hidden_states_of_the_named_layers(which, fast_target):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()
    ids = torch.tensor(transformers.AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR)(TEXT)["input_ids"])
    model = load_for_inference(DEFAULT_TARGET_DIR) if which == "eager" else fast_target
    cache = KVCache(model.cfg, 128)
    with torch.no_grad():
        states = oracle(ids[None], output_hidden_states=True).hidden_states  # [0]: embeddings, [i+1]: layer i's output
        expected = torch.cat([states[i + 1][0] for i in (0, 1, 2)], dim=-1)
        # A prefill (fill_cache) then a verify-sized window and single steps, as the engine calls it.
        pieces = [model.fill_cache(ids[:10], RaggedBatch.build([0], [0], [10]), cache, features=True,
                                   capture=(0, 1, 2))]
        pieces += [model.forward_ragged(ids[10:14], RaggedBatch.build([0], [10], [4]), cache, capture=(0, 1, 2)).aux]
        pieces += [model.forward_ragged(ids[i:i + 1], RaggedBatch.build([0], [i], [1]), cache, capture=(0, 1, 2)).aux
                   for i in range(14, ids.shape[0])]
    got = torch.cat(pieces)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)


def test_a_pass_without_capture_is_bitwise_unchanged(fast_target):
    """Plain decoding asks for no capture; a capture changes nothing but the extra output."""
    ids = torch.arange(5, 45)
    outs = []
    for capture in ((), (0, 1, 2)):
        cache = KVCache(fast_target.cfg, 64)
        with torch.no_grad():
            fast_target.fill_cache(ids[:30], RaggedBatch.build([0], [0], [30]), cache, capture=capture,
                                   features=bool(capture))
            steps = [fast_target.forward_ragged(ids[i:i + 1], RaggedBatch.build([0], [i], [1]), cache,
                                                capture=capture) for i in range(30, 40)]
        outs.append(steps)
    for plain, captured in zip(*outs, strict=True):
        assert plain.aux is None and captured.aux is not None
        assert torch.equal(plain.logits, captured.logits)
        assert torch.equal(plain.features, captured.features)
        assert torch.equal(plain.routed_ids, captured.routed_ids)
