"""DraftPolicy -> sglang.Engine keyword arguments, and the ModelInfo this backend reports.

Mapping (server-argument names from python/sglang/srt/arg_groups/fields/spec.py in 0.5.23):
- draft_length 0: no speculative_* argument at all (plain decoding).
- model drafter, k > 0: speculative_algorithm = the configured STANDALONE|EAGLE|EAGLE3|NEXTN,
  speculative_num_steps = k, speculative_eagle_topk = 1, speculative_num_draft_tokens = k + 1
  (a chain: one verify window of k + 1 positions per request).
- n-gram drafter, k > 0: speculative_algorithm = NGRAM, speculative_num_draft_tokens = k + 1 and
  min/max BFS breadth 1: each match the corpus finds continues as one branch, but matches of
  different lengths that continue differently still branch off the root, so an NGRAM window is a
  small tree (draft_tree.py). SGLang's NGRAM always verifies all k + 1 positions (it pads when the
  cache finds too little), so empty drafts cost a full window there and are not counted as empty.
- model drafter, k > 1, tree_width w > 1 (EAGLE/EAGLE3 only): the same, but speculative_eagle_topk = w:
  SGLang's EAGLE-2 tree. Each of k draft steps expands the w best candidates w ways, and the k best
  of all candidates by path score (of any depth up to k) are verified in one window of k + 1 positions
  under a tree mask: k nodes, as the embedded engine's trees of width w. Never adaptive (SGLang's
  adaptive states are topk 1), so a tree policy always runs on an engine of its own. k = 1 drafts one
  node whatever the width: it runs as the chain. Other algorithms refuse trees (ModelInfo.max_tree_width
  is 1 there).
- draft_temperature: no SGLang knob. Chain drafts are the draft model's argmax; with
  speculative_use_rejection_sampling (EAGLE/EAGLE3/NEXTN only) the draft samples at the request's own
  temperature. So it is never listed as tunable and StepRecords carry 0.0 (argmax).
All of these are start-up arguments, so a policy whose arguments differ needs another engine
(`swap_gate.py` drains and swaps it; backend.py measures the cost). policy_id and draft_temperature changes are free.
Except for prepared lengths: EAGLE/EAGLE3 engines start with speculative_adaptive and one runtime
state per prepared length (SpecConfig.prepared_lengths), and a change among them is a pin of the step
count through the plugin (`step_switch`), not another engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service.types import MAX_TREE_WIDTH, Drafter, DraftPolicy, InvalidRequest

MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
# Algorithms whose draft is a separate checkpoint; NEXTN can use the target's own MTP layers.
NEEDS_DRAFT_PATH = ("STANDALONE", "EAGLE", "EAGLE3")
# Algorithms whose draft shares the target's embedding (and head), which SGLang 0.5.23 asks a target for
# through a method its Qwen2-MoE class lacks: the plugin supplies it (service/sglang_plugin/embed_head.py).
SHARES_TARGET_EMBEDDING = ("EAGLE", "EAGLE3")
# Algorithms SGLang 0.5.23 runs with speculative_adaptive (one runtime state per step count, topk 1).
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")
# Algorithms whose drafts may be trees (speculative_eagle_topk > 1), as far as moespec offers them.
TREE_ALGORITHMS = ("EAGLE", "EAGLE3")
# What differs between two engines of prepared lengths: the step count and the window it implies.
STEP_ARGUMENTS = ("speculative_num_steps", "speculative_num_draft_tokens")
EFFECTIVE_DRAFT_TEMPERATURE = 0.0


@dataclass(frozen=True)
class SpecConfig:
    """What the operator chose at `moespec serve` time; fixed for the server's life."""

    model_algorithm: str | None  # one of MODEL_ALGORITHMS; None: only the n-gram drafter
    draft_model_path: str | None
    ngram: bool = True  # offer SGLang's NGRAM drafter
    ngram_max_trie_depth: int | None = None
    # Model-drafter lengths one adaptive engine serves (ADAPTIVE_ALGORITHMS only; 0 = plain decoding on
    # it), and SGLang's adaptive config file listing them (adaptive_config); () = an engine per length.
    prepared_lengths: tuple[int, ...] = ()
    adaptive_config_path: str | None = None
    # EAGLE/EAGLE3 trees: the temperature their candidates are ranked at (the plugin's tree_ranking.py);
    # 1.0: SGLang's own ranking, the draft's plain softmax.
    tree_ranking_temperature: float = 1.0

    def drafters(self) -> tuple[Drafter, ...]:
        return tuple(d for d, ok in ((Drafter.MODEL, self.model_algorithm is not None), (Drafter.NGRAM, self.ngram))
                     if ok)


def speculative_kwargs(policy: DraftPolicy, spec: SpecConfig) -> dict:
    """The speculative_* engine arguments for a policy ({} = speculation off). k = 0 where 0 is a prepared
    length: the adaptive model-drafter engine at 0 steps (SGLang verifies each request's one next token
    without drafting: a plain decode step, plus the draft's KV catch-up), so plain costs no swap either."""
    if policy.tree_width > max_tree_width(spec):  # before the k = 0 shortcut: refused whatever its length
        raise InvalidRequest("policy.tree_width", f"{policy.tree_width}: this server's drafts are chains only "
                             f"(ModelInfo.max_tree_width {max_tree_width(spec)}; trees need "
                             f"--speculative-algorithm {' or '.join(TREE_ALGORITHMS)}): give tree_width 1")
    k = policy.draft_length
    if k == 0 and 0 not in spec.prepared_lengths:
        return {}
    if k and policy.drafter not in spec.drafters():
        raise InvalidRequest("policy.drafter", f"this server offers {[d.value for d in spec.drafters()]}")
    if k and policy.drafter is Drafter.NGRAM:
        out = {
            "speculative_algorithm": "NGRAM",
            "speculative_num_draft_tokens": k + 1,
            "speculative_ngram_min_bfs_breadth": 1,
            "speculative_ngram_max_bfs_breadth": 1,
        }
        if spec.ngram_max_trie_depth is not None:
            out["speculative_ngram_max_trie_depth"] = spec.ngram_max_trie_depth
        return out
    tree = policy.tree_width > 1 and k > 1
    out = {
        "speculative_algorithm": spec.model_algorithm,
        "speculative_num_steps": k,
        "speculative_eagle_topk": policy.tree_width if tree else 1,
        "speculative_num_draft_tokens": k + 1,
    }
    if spec.draft_model_path:
        out["speculative_draft_model_path"] = spec.draft_model_path
    if k in spec.prepared_lengths and not tree:
        out["speculative_adaptive"] = True
        out["speculative_adaptive_config"] = spec.adaptive_config_path
    return out


def adaptive_config(prepared_lengths: tuple[int, ...]) -> dict:
    """SGLang's speculative_adaptive_config for these lengths: one slot for every batch size (the key is
    the smallest batch it covers), its candidate step counts the lengths. Its acceptance rule never runs
    while moespec pins the count (step_pin.py), so the rule's own settings are left at SGLang's defaults."""
    return {"1": {"candidate_steps": sorted(prepared_lengths)}}


def start_arguments(wanted: dict, spec: SpecConfig) -> dict:
    """The speculative arguments to start an engine with for `wanted`: itself, except that an adaptive engine
    wanted at 0 steps starts at the smallest positive prepared length and is pinned to 0 once up. SGLang
    keeps a request's speculative counts (meta_info's verify count and acceptance histogram) from the
    start-up step count, and started at 0 it keeps none for the lengths pinned later."""
    if not wanted.get("speculative_adaptive") or wanted["speculative_num_steps"]:
        return wanted
    steps = min(k for k in spec.prepared_lengths if k > 0)
    return {**wanted, "speculative_num_steps": steps, "speculative_num_draft_tokens": steps + 1}


def step_switch(running: dict, wanted: dict) -> int | None:
    """The step count to pin where the engine started with `running` speculative arguments serves `wanted`
    as it is (both adaptive, equal but for the step count); None where `wanted` needs another engine."""
    if not (running.get("speculative_adaptive") and wanted.get("speculative_adaptive")):
        return None

    def rest(kwargs: dict) -> dict:
        return {k: v for k, v in kwargs.items() if k not in STEP_ARGUMENTS}

    return wanted["speculative_num_steps"] if rest(running) == rest(wanted) else None


def engine_tree_temperature(spec_kwargs: dict, spec: SpecConfig) -> float | None:
    """The temperature the plugin ranks this engine's tree candidates at; None: SGLang's own ranking (a
    chain, or no temperature configured)."""
    tree = spec_kwargs.get("speculative_eagle_topk", 1) > 1
    return spec.tree_ranking_temperature if tree and spec.tree_ranking_temperature != 1.0 else None


def needs_eagle_target(spec_kwargs: dict) -> bool:
    """Whether an engine with these speculative arguments needs the plugin's target embedding/head lookup."""
    return spec_kwargs.get("speculative_algorithm") in SHARES_TARGET_EMBEDDING


def engine_key(policy: DraftPolicy, spec: SpecConfig) -> tuple:
    """Policies with the same key run on the same engine (no swap)."""
    return tuple(sorted(speculative_kwargs(policy, spec).items()))


def verify_width(policy: DraftPolicy) -> int:
    """Tokens each request contributes to one verify pass (1 = a plain decode step)."""
    return policy.draft_length + 1


def effective_policy(policy: DraftPolicy) -> DraftPolicy:
    """The policy as SGLang runs it: the draft temperature is not SGLang's to set. Model drafts are
    the draft's argmax, NGRAM proposes deterministically and k = 0 drafts nothing, so every step
    reports 0.0, whatever the policy carried (its default is 1.0)."""
    return dataclasses.replace(policy, draft_temperature=EFFECTIVE_DRAFT_TEMPERATURE)


def max_tree_width(spec: SpecConfig) -> int:
    """The widest draft tree this server offers (1: chains only)."""
    return MAX_TREE_WIDTH if spec.model_algorithm in TREE_ALGORITHMS else 1


def tunable_knobs(spec: SpecConfig) -> tuple[str, ...]:
    """What the tuner may search here: the length always (0 = off is always valid), the drafter
    when there are two to choose from, the tree width where trees are offered, never the draft
    temperature."""
    drafter = ("drafter",) if len(spec.drafters()) > 1 else ()
    return (*drafter, "draft_length", *(("tree_width",) if max_tree_width(spec) > 1 else ()))

