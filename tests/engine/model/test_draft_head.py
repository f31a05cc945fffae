"""The draft head against a plain-torch reference written from its formula, on the target's
features from transformers; its C chain against its torch rounds; training's unrolled steps against
what drafting computes; its cache after rejected drafts; and its sampled picks against its q."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from service.engine.engine import Engine, EngineConfig
from service.engine.kernels import library as kernels
from service.engine.model.draft_head import DraftHead, load_head
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import DEFAULT_HEAD_DIR, DEFAULT_TARGET_DIR, load_model
from service.engine.spec.model_drafting import chain_reference
from service.types import DraftPolicy, GenerationRequest, SamplingParams

transformers = pytest.importorskip("transformers")

TEXT = ("import os\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n\n\n"
        "def write_config(path, text):\n    with open(path, 'w') as f:\n        f.write(text)\n")


@pytest.fixture(scope="module")
def built():
    k = kernels.build()
    assert k is not None, "the kernels did not build"
    return k


@pytest.fixture(scope="module")
def target():
    return load_model(DEFAULT_TARGET_DIR)


@pytest.fixture(scope="module")
def oracle_features():
    """ids [T] of TEXT and the target's normed final hidden states [T, H] from transformers."""
    oracle = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=torch.float32).eval()
    ids = torch.tensor(transformers.AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR)(TEXT)["input_ids"])
    with torch.no_grad():
        return ids, oracle.model(ids[None]).last_hidden_state[0]


def shifted(features: torch.Tensor) -> torch.Tensor:
    """Entry p reads feature p - 1 (zeros at p = 0)."""
    return torch.cat([features.new_zeros(1, features.shape[1]), features[:-1]])


def reference_head(state: dict[str, torch.Tensor], embed: torch.Tensor, tokens: torch.Tensor,
                   features: torch.Tensor, heads: int, kv_heads: int, theta: float, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's formula, written out: every entry p of tokens [m] with its input feature [m, H]
    -> (logits [m, Vd], feature estimates [m, H])."""
    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [m, heads, D]: pairs (d, d + D/2) rotated by pos * theta^(-2d/D)
        D = x.shape[-1]
        angle = pos[:, None].double() * theta ** (-torch.arange(0, D, 2).double() / D)  # [m, D/2]
        c, s = angle.cos().float()[:, None], angle.sin().float()[:, None]
        a, b = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    m = tokens.shape[0]
    x = torch.cat([rms(embed[tokens], state["embed_norm.weight"]), rms(features, state["feature_norm.weight"])], -1)
    x = x @ state["fc.weight"].T
    h = rms(x, state["layer.input_layernorm.weight"])
    attn = "layer.self_attn."
    q = (h @ state[attn + "q_proj.weight"].T + state[attn + "q_proj.bias"]).view(m, heads, -1)
    k = (h @ state[attn + "k_proj.weight"].T + state[attn + "k_proj.bias"]).view(m, kv_heads, -1)
    v = (h @ state[attn + "v_proj.weight"].T + state[attn + "v_proj.bias"]).view(m, kv_heads, -1)
    pos = torch.arange(m)
    q, k = rope(q, pos), rope(k, pos)
    group = heads // kv_heads
    out = torch.empty_like(q)
    for p in range(m):
        for a in range(heads):
            scores = (k[:p + 1, a // group] @ q[p, a]) / math.sqrt(q.shape[-1])
            out[p, a] = scores.softmax(0) @ v[:p + 1, a // group]
    x = x + out.reshape(m, -1) @ state[attn + "o_proj.weight"].T
    h = rms(x, state["layer.post_attention_layernorm.weight"])
    mlp = "layer.mlp."
    x = x + (torch.nn.functional.silu(h @ state[mlp + "gate_proj.weight"].T) * (h @ state[mlp + "up_proj.weight"].T)) \
        @ state[mlp + "down_proj.weight"].T
    return rms(x, state["norm.weight"]) @ state["lm_head.weight"].T, x


@pytest.fixture(scope="module")
def head(built):
    return load_head(DEFAULT_HEAD_DIR, kernels=built)


def fresh_chain_weights(head: DraftHead, target, slots: int = 1, length: int = 128):
    cache = KVCache(head.cfg, length, slots=slots)
    return cache, head.chain_weights(target.embed_tokens.weight, cache)


def test_head_logits_match_the_formula_on_transformers_features(head, target, oracle_features):
    ids, features = oracle_features
    plain = load_head(DEFAULT_HEAD_DIR, for_inference=False)
    state = {k: v.float() for k, v in plain.state_dict().items() if k != "vocab"}
    cfg = plain.cfg
    expected, _ = reference_head(state, target.embed_tokens.weight, ids, shifted(features), cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.rope_theta, cfg.rms_norm_eps)
    # The torch path (every entry's logits) and the C call (the last entry's distribution and pick).
    with torch.inference_mode():
        cache, weights = fresh_chain_weights(head, target)
        batch = RaggedBatch.build([0], [0], [ids.shape[0]])
        got, _ = head.forward_ragged(target.embed_tokens(ids), shifted(features), batch, cache,
                                     torch.arange(ids.shape[0]))
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
        for temperature in (0.7, 1.3):
            _, q = head.kernels.head_draft(weights, ids, shifted(features), 0, 0, 1, temperature, torch.rand(1))
            torch.testing.assert_close(q[0], (expected[-1] / temperature).softmax(-1), atol=1e-5, rtol=1e-4)
        picks, _ = head.kernels.head_draft(weights, ids, shifted(features), 0, 0, 1, 0.0, None)
        assert int(picks[0]) == int(expected[-1].argmax())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_c_chain_makes_the_torch_rounds_picks_and_distributions(head, target, oracle_features, temperature):
    ids, features = oracle_features
    k, m = 6, 20
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(4):
            uniforms = torch.rand(k, generator=gen) if temperature else None
            cache, weights = fresh_chain_weights(head, target)
            assert m <= ids.shape[0]
            batch = RaggedBatch.build([0], [0], [m])
            logits, feature = head.forward_ragged(target.embed_tokens(ids[:m]), shifted(features)[:m], batch, cache,
                                                  torch.tensor([m - 1]))
            expected, expected_q = chain_reference(head, target.embed_tokens, cache, 0, m, k, logits[0], feature[0],
                                                   temperature, uniforms)
            cache, weights = fresh_chain_weights(head, target)
            picks, q = head.kernels.head_draft(weights, ids[:m], shifted(features)[:m], 0, 0, k, temperature, uniforms)
            assert picks.tolist() == expected.tolist()
            if temperature:
                torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-5)
            m += 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_c_chain_split_over_threads_is_bitwise_the_one_thread_chain(head, target, oracle_features, temperature):
    """Catch-ups of 1, 3 (attention split by kv head) and 20 entries (split by token), then 5 drafts:
    the same picks, distributions and cache entries with a pool of 2 and 3 threads as alone."""
    ids, features = oracle_features
    for threads in (2, 3):
        pool = head.kernels.pool(threads)
        try:
            for m in (1, 3, 20):
                uniforms = torch.rand(5, generator=torch.Generator().manual_seed(m)) if temperature else None
                runs = []
                for p in (None, pool):
                    cache, weights = fresh_chain_weights(head, target)
                    with torch.inference_mode():
                        picks, q = head.kernels.head_draft(weights, ids[:m], shifted(features)[:m], 0, 0, 5,
                                                           temperature, uniforms, p)
                    runs.append((picks, q, cache))
                (a, qa, ca), (b, qb, cb) = runs
                assert torch.equal(a, b) and torch.equal(ca.k, cb.k) and torch.equal(ca.v, cb.v)
                assert (qa is None and qb is None) or torch.equal(qa, qb)
        finally:
            pool.close()


def test_training_unrolled_steps_compute_what_drafting_computes(head, target, oracle_features):
    """Step 1 at entry p reads the true feature p - 1; step 2 at entry p reads step 1's estimate at
    p - 1 and attends to the true entries up to p - 1 and to itself: exactly a chain's second round."""
    ids, features = oracle_features
    plain = load_head(DEFAULT_HEAD_DIR, for_inference=False)
    with torch.no_grad():
        steps = plain.forward_train(target.embed_tokens(ids)[None], features[None], steps=2)
    (logits1, fhat1), (logits2, _) = steps
    with torch.inference_mode():
        for c in (5, 17, ids.shape[0] - 2):
            cache = KVCache(plain.cfg, 128)
            batch = RaggedBatch.build([0], [0], [c + 1])  # true entries 0..c
            got1, fhat = plain.forward_ragged(target.embed_tokens(ids[:c + 1]), shifted(features)[:c + 1], batch,
                                              cache, torch.tensor([c]))
            torch.testing.assert_close(got1[0], logits1[0, c], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fhat[0], fhat1[0, c], atol=1e-4, rtol=1e-4)
            # entry c + 1 fed the estimate at c and the true token c + 1 (what step 2 trains on)
            got2, _ = plain.forward_ragged(target.embed_tokens(ids[c + 1:c + 2]), fhat,
                                           RaggedBatch.build([0], [c + 1], [1]), cache, torch.tensor([0]))
            torch.testing.assert_close(got2[0], logits2[0, c + 1], atol=1e-4, rtol=1e-4)


def test_drafts_after_rejections_equal_drafts_from_a_fresh_cache(target):
    """Every step's drafts are what a head with an empty cache drafts from the committed tokens alone:
    entries computed from the head's own estimates are never read after verification."""
    engine = Engine(EngineConfig(threads=1, capture_topk=True, max_batch=2))
    try:
        prompt = engine.tokenizer.encode(TEXT).ids
        result = engine.generate(GenerationRequest(prompt_token_ids=tuple(prompt), max_new_tokens=40,
                                                   sampling=SamplingParams(temperature=0)),
                                 DraftPolicy(draft_length=4, draft_temperature=0.0))
        assert any(0 < s.accepted < s.drafted for s in result.steps), "no step rejected a draft after accepting one"
        done = 0  # output tokens committed before the step
        with torch.inference_mode():
            for step in result.steps:
                if not step.drafted:  # the last step may have no room left to draft
                    done += step.committed
                    continue
                ids = torch.tensor(prompt + list(result.token_ids[:done]))
                features = engine.target.forward(ids, 0, KVCache(engine.target.cfg, 512)).features
                cache, weights = fresh_chain_weights(engine.draft, engine.target, length=512)
                picks, _ = engine.draft.kernels.head_draft(weights, ids, shifted(features), 0, 0, step.drafted, 0.0,
                                                           None)
                assert engine.draft.vocab[picks].tolist() == list(step.window_ids[1:])
                done += step.committed
    finally:
        engine.close()


def test_sampled_picks_follow_the_distribution_they_report(head, target, oracle_features):
    ids, features = oracle_features
    gen = torch.Generator().manual_seed(11)
    draws = 4000
    with torch.inference_mode():
        cache, weights = fresh_chain_weights(head, target)
        picks = [int(head.kernels.head_draft(weights, ids, shifted(features), 0, 0, 1, 1.2,
                                             torch.rand(1, generator=gen))[0][0]) for _ in range(draws)]
        _, q = head.kernels.head_draft(weights, ids, shifted(features), 0, 0, 1, 1.2, torch.rand(1))
    q = q[0].double()
    likely = (q * draws >= 5).nonzero().view(-1)
    observed = torch.bincount(torch.tensor(picks), minlength=q.shape[0]).double()
    f_obs = torch.cat([observed[likely], (observed.sum() - observed[likely].sum())[None]])
    f_exp = torch.cat([q[likely], (1 - q[likely].sum())[None]]) * draws
    assert chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-3



@pytest.mark.parametrize("change,message", [
    ({"tokens": torch.tensor([5, 10**6])}, "token ids must lie"),
    ({"width": 9}, "width 9"),
    ({"taus": torch.ones(2)}, "taus must be"),
    ({"start": 10**6}, "do not fit the cache"),
])
def test_the_tree_kernel_refuses_what_it_cannot_run_naming_it(change, message):
    from service.engine.model.weights import load_for_inference

    built = kernels.build()
    target = load_for_inference(DEFAULT_TARGET_DIR, kernels=built)
    head = load_head(DEFAULT_HEAD_DIR, kernels=built)
    cache = KVCache(head.cfg, 64)
    chain = head.chain_weights(target.embed_tokens.weight, cache)
    args = {"tokens": torch.tensor([5, 6]), "width": 2, "taus": torch.ones(4), "start": 0}
    args.update(change)
    features = torch.zeros(args["tokens"].shape[0], target.cfg.hidden_size)
    with pytest.raises(ValueError, match=message):
        head.kernels.head_tree(chain, args["tokens"], features, 0, args["start"], 4, args["width"], args["taus"])
