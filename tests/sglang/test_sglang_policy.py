"""DraftPolicy -> sglang.Engine arguments, and what the backend reports as tunable."""

from __future__ import annotations

import argparse
import json

import pytest

from service.errors import UsageError
from service.sglang_backend import add_arguments
from service.sglang_backend.cli import base_kwargs, initial_policy
from service.sglang_backend.info import build_info
from service.sglang_backend.model_config import moe_geometry
from service.sglang_backend.policy import (
    SpecConfig,
    effective_policy,
    engine_key,
    speculative_kwargs,
    tunable_knobs,
    verify_width,
)
from service.sglang_backend.sampling import sampling_params
from service.types import Controller, Drafter, DraftPolicy, GenerationRequest, InvalidRequest, SamplingParams

STANDALONE = SpecConfig(model_algorithm="STANDALONE", draft_model_path="/models/draft")


def test_draft_length_zero_turns_speculation_off():
    assert speculative_kwargs(DraftPolicy(draft_length=0), STANDALONE) == {}
    assert verify_width(DraftPolicy(draft_length=0)) == 1


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_length_k_is_k_steps_topk_1_and_k_plus_1_draft_tokens(k):
    assert speculative_kwargs(DraftPolicy(Drafter.MODEL, k), STANDALONE) == {
        "speculative_algorithm": "STANDALONE",
        "speculative_num_steps": k,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": k + 1,
        "speculative_draft_model_path": "/models/draft",
    }


def test_nextn_needs_no_draft_path():
    spec = SpecConfig(model_algorithm="NEXTN", draft_model_path=None)
    kwargs = speculative_kwargs(DraftPolicy(Drafter.MODEL, 2), spec)
    assert kwargs["speculative_algorithm"] == "NEXTN" and "speculative_draft_model_path" not in kwargs


def test_ngram_drafter_maps_to_sglang_ngram_as_a_chain():
    spec = SpecConfig(model_algorithm="STANDALONE", draft_model_path="/d", ngram_max_trie_depth=12)
    assert speculative_kwargs(DraftPolicy(Drafter.NGRAM, 4), spec) == {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": 5,
        "speculative_ngram_min_bfs_breadth": 1,
        "speculative_ngram_max_bfs_breadth": 1,
        "speculative_ngram_max_trie_depth": 12,
    }


def test_a_drafter_the_server_does_not_offer_is_invalid():
    ngram_only = SpecConfig(model_algorithm=None, draft_model_path=None)
    with pytest.raises(InvalidRequest) as e:
        speculative_kwargs(DraftPolicy(Drafter.MODEL, 2), ngram_only)
    assert e.value.field == "policy.drafter"
    no_ngram = SpecConfig(model_algorithm="STANDALONE", draft_model_path="/d", ngram=False)
    with pytest.raises(InvalidRequest):
        speculative_kwargs(DraftPolicy(Drafter.NGRAM, 2), no_ngram)


EAGLE3 = SpecConfig(model_algorithm="EAGLE3", draft_model_path="/models/eagle3", prepared_lengths=(0, 1, 2, 3, 4),
                    adaptive_config_path="/tmp/adaptive.json")


def test_only_a_tree_engine_ranks_at_the_configured_temperature():
    from dataclasses import replace

    from service.sglang_backend.policy import engine_tree_temperature

    tree = speculative_kwargs(DraftPolicy(Drafter.MODEL, 4, 0.0, tree_width=2), EAGLE3)
    chain = speculative_kwargs(DraftPolicy(Drafter.MODEL, 4, 0.0), EAGLE3)
    ranked = replace(EAGLE3, tree_ranking_temperature=0.15)
    assert engine_tree_temperature(tree, ranked) == 0.15
    assert engine_tree_temperature(chain, ranked) is None  # a chain is the argmax: nothing to rank
    assert engine_tree_temperature(tree, EAGLE3) is None  # 1.0: SGLang's own ranking


@pytest.mark.parametrize("k", [0, 4])
def test_a_tree_is_refused_naming_the_field_where_the_algorithm_drafts_chains(k):
    with pytest.raises(InvalidRequest) as e:
        speculative_kwargs(DraftPolicy(Drafter.MODEL, k, 0.0, tree_width=2), STANDALONE)
    assert e.value.field == "policy.tree_width" and "chains only" in str(e.value) and "EAGLE3" in str(e.value)


@pytest.mark.parametrize("width", [2, 4])
def test_an_eagle_tree_is_topk_width_over_k_steps_verifying_k_nodes_on_an_engine_of_its_own(width):
    got = speculative_kwargs(DraftPolicy(Drafter.MODEL, 4, 0.0, tree_width=width), EAGLE3)
    assert got == {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 4, "speculative_eagle_topk": width,
                   "speculative_num_draft_tokens": 5, "speculative_draft_model_path": "/models/eagle3"}
    chain = speculative_kwargs(DraftPolicy(Drafter.MODEL, 4, 0.0), EAGLE3)
    assert chain["speculative_adaptive"] and chain["speculative_eagle_topk"] == 1  # a prepared length
    assert engine_key(DraftPolicy(Drafter.MODEL, 4, 0.0, tree_width=width), EAGLE3) != engine_key(
        DraftPolicy(Drafter.MODEL, 4, 0.0), EAGLE3)
    # One node is a chain whatever the width: the prepared length's engine.
    assert speculative_kwargs(DraftPolicy(Drafter.MODEL, 1, 0.0, tree_width=width), EAGLE3) == speculative_kwargs(
        DraftPolicy(Drafter.MODEL, 1, 0.0), EAGLE3)


def test_only_start_up_arguments_force_an_engine_swap():
    base = DraftPolicy(Drafter.MODEL, 3, 1.0, "a")
    assert engine_key(base, STANDALONE) == engine_key(DraftPolicy(Drafter.MODEL, 3, 0.3, "b"), STANDALONE)
    assert engine_key(base, STANDALONE) != engine_key(DraftPolicy(Drafter.MODEL, 4, 1.0, "a"), STANDALONE)
    assert engine_key(base, STANDALONE) != engine_key(DraftPolicy(Drafter.NGRAM, 3, 1.0, "a"), STANDALONE)
    assert engine_key(DraftPolicy(Drafter.MODEL, 0), STANDALONE) == engine_key(DraftPolicy(Drafter.NGRAM, 0),
                                                                                 STANDALONE)


def test_draft_temperature_is_reported_as_argmax_and_never_tunable():
    assert effective_policy(DraftPolicy(Drafter.MODEL, 3, 0.7)).draft_temperature == 0.0
    # Finding 3 (sglang-cpu-notes): k = 0 and NGRAM reported the policy's default 1.0.
    assert effective_policy(DraftPolicy(Drafter.MODEL, 0)).draft_temperature == 0.0
    assert effective_policy(DraftPolicy(Drafter.NGRAM, 4)).draft_temperature == 0.0
    assert tunable_knobs(STANDALONE) == ("drafter", "draft_length")
    assert tunable_knobs(SpecConfig(model_algorithm=None, draft_model_path=None)) == ("draft_length",)
    assert "draft_temperature" not in tunable_knobs(STANDALONE)


def test_model_info_of_the_shipped_target(tmp_path):
    target = moe_geometry(_shipped_like(tmp_path))
    info = build_info(target, "draft", STANDALONE, max_context=512)
    assert (info.backend, info.num_layers, info.num_experts, info.top_k, info.shared_experts) == ("sglang", 4, 64, 8, 1)
    assert info.drafters == (Drafter.MODEL, Drafter.NGRAM)
    assert info.tunable == ("drafter", "draft_length")
    assert info.expert_bytes == 3 * 256 * 64 * 2  # gate, up, down of one expert in bf16
    assert info.policy_switch_seconds == 0.0 and info.policy_switches == 0
    assert info.controllers == (Controller.STATIC,) and "EAGLE" in info.controllers_note  # says why
    assert not info.policy_tables  # speculation is fixed at engine start-up: one policy for every step
    assert info.max_tree_width == 1 and "tree_width" not in info.tunable  # STANDALONE: chains only
    eagle = build_info(target, "eagle3", EAGLE3, max_context=512)
    assert eagle.max_tree_width == 4 and eagle.tunable == ("drafter", "draft_length", "tree_width")


def test_moe_layers_follow_each_family_config(tmp_path):
    deepseek = _model_dir(tmp_path / "ds", {
        "model_type": "deepseek_v3", "num_hidden_layers": 6, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1, "hidden_size": 7168,
        "moe_intermediate_size": 2048})
    g = moe_geometry(deepseek)
    assert g.moe_layers == (3, 4, 5) and g.num_experts == 256 and g.shared_experts == 1
    qwen3 = _model_dir(tmp_path / "q3", {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 128,
                                         "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [0]})
    g = moe_geometry(qwen3)
    assert g.moe_layers == (1, 2, 3) and g.shared_experts == 0


def test_sampling_params_use_sglang_names():
    request = GenerationRequest(prompt="x", max_new_tokens=7, stop=("\n\n",),
                                sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=20, seed=3))
    assert sampling_params(request) == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                                        "sampling_seed": 3, "stop": ["\n\n"]}
    assert "top_k" not in sampling_params(GenerationRequest(prompt="x"))  # 0 = off = SGLang's default


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--drafter", default="model")
    parser.add_argument("--draft-length", type=int, default=0)
    parser.add_argument("--tree-width", type=int, default=1)
    return parser.parse_args(list(argv))


def test_engine_arguments_turn_off_shared_expert_fusion_and_leave_the_recorder_off():
    args = parse("--model-path", "/m", "--sglang-arg", "cuda_graph_max_bs_decode=8", "--sglang-arg", "dtype=bfloat16")
    kwargs = base_kwargs(args)
    assert kwargs["disable_shared_experts_fusion"] is True  # a fused shared expert would take a routed slot
    assert kwargs["chunked_prefill_size"] == 4096
    assert kwargs["cuda_graph_max_bs_decode"] == 8 and kwargs["dtype"] == "bfloat16"
    # The plugin measures; SGLang's per_token recorder runs only as the --sglang-record-dir cross-check.
    assert "expert_distribution_recorder_mode" not in kwargs


def test_speculative_arguments_cannot_be_passed_around_the_policy():
    with pytest.raises(UsageError, match="follow the draft policy"):
        base_kwargs(parse("--model-path", "/m", "--sglang-arg", "speculative_num_steps=3"))
    with pytest.raises(UsageError, match="KEY=VALUE"):
        base_kwargs(parse("--model-path", "/m", "--sglang-arg", "oops"))


def test_initial_policy_comes_from_serve_flags():
    assert initial_policy(parse("--draft-length", "2"), STANDALONE).draft_length == 2
    ngram_only = SpecConfig(model_algorithm=None, draft_model_path=None)
    with pytest.raises(UsageError, match="offers ngram"):
        initial_policy(parse("--draft-length", "2"), ngram_only)
    with pytest.raises(UsageError, match="--tree-width 2: this sglang configuration drafts chains only"):
        initial_policy(parse("--draft-length", "2", "--tree-width", "2"), STANDALONE)
    assert initial_policy(parse("--draft-length", "3", "--tree-width", "2"), EAGLE3).tree_width == 2


def _model_dir(path, config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _shipped_like(tmp_path):
    return _model_dir(tmp_path / "target", {
        "model_type": "qwen2_moe", "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4,
        "max_position_embeddings": 512, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "torch_dtype": "bfloat16"})


def test_the_servicer_can_send_the_backend_info(tmp_path):
    from service.server.convert import info_to_pb

    msg = info_to_pb(build_info(moe_geometry(_shipped_like(tmp_path)), "draft", STANDALONE, max_context=512))
    assert msg.backend == "sglang" and list(msg.tunable) == ["drafter", "draft_length"] and msg.num_layers == 4
