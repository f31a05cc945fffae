"""The SGLang names the plugin hooks, and the start-up check that they are there.

The plugin changes SGLang only through its hook registry at these dotted paths. The moespec server
checks them in its own process before it starts an engine (same SGLang install as the scheduler's),
so another SGLang version fails in one line instead of measuring nothing.
"""

from __future__ import annotations

import inspect
import pkgutil

SGLANG_VERSION = "0.5.23"  # the release these hook points were read in

RECORDER_FACTORY = "sglang.srt.eplb.expert_distribution.ExpertDistributionRecorder.init_new"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
# The recorder methods the models call, which the tap forwards and listens to.
RECORDER_CALLS = ("with_current_layer", "on_select_experts", "with_forward_pass")
RECORDER_CLASS = "sglang.srt.eplb.expert_distribution.ExpertDistributionRecorder"
FORWARD_BATCH_FIELDS = ("forward_mode", "rids", "batch_size", "input_ids", "positions")
FORWARD_BATCH_CLASS = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
# Where every EAGLE-family draft worker asks the target for its embedding and LM head (embed_head.py).
TARGET_EMBED_AND_HEAD = "sglang.srt.speculative.pp_draft_embedding.resolve_target_embed_and_head"
# The adaptive EAGLE step count's policy object and the scheduler's RPC entry (step_pin.py).
ADAPTIVE_PARAMS = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
ADAPTIVE_STEPS_FOR_BATCH = f"{ADAPTIVE_PARAMS}.get_steps_for_batch"
ADAPTIVE_VERIFY_COMPLETE = f"{ADAPTIVE_PARAMS}.on_verify_complete"
SCHEDULER_RPC = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
# Where an EAGLE draft's probabilities are made, which rank a tree's candidates (tree_ranking.py).
DRAFT_PROBS = "sglang.srt.speculative.spec_utils.renorm_draft_probs"
DRAFT_PROBS_PARAMETERS = ["next_token_logits", "sampling_info", "use_rejection_sampling"]
STEP_PIN_SIGNATURES = {
    ADAPTIVE_STEPS_FOR_BATCH: ["self", "batch_size"],
    ADAPTIVE_VERIFY_COMPLETE: ["self", "num_correct_drafts_per_req", "batch_size"],
    SCHEDULER_RPC: ["self", "recv_req"],
}


class HookPointError(RuntimeError):
    """The installed SGLang lacks a name the plugin hooks (another version)."""


def check_hook_points() -> None:
    """Raises HookPointError naming the first missing hook point of the tap."""
    try:
        factory = pkgutil.resolve_name(RECORDER_FACTORY)
        forward = pkgutil.resolve_name(MODEL_FORWARD)
        recorder = pkgutil.resolve_name(RECORDER_CLASS)
        batch = pkgutil.resolve_name(FORWARD_BATCH_CLASS)
    except (ImportError, AttributeError) as e:
        raise HookPointError(f"{e} (the moespec plugin hooks SGLang {SGLANG_VERSION})") from None
    checks = [
        (list(inspect.signature(factory).parameters)[:2] == ["expert_location_metadata", "rank"],
         f"{RECORDER_FACTORY}(expert_location_metadata, rank)"),
        ("forward_batch" in inspect.signature(forward).parameters, f"{MODEL_FORWARD}(self, forward_batch, ...)"),
        *((hasattr(recorder, name), f"{RECORDER_CLASS}.{name}") for name in RECORDER_CALLS),
        *((name in getattr(batch, "__dataclass_fields__", {}), f"{FORWARD_BATCH_CLASS}.{name}")
          for name in FORWARD_BATCH_FIELDS),
    ]
    for ok, name in checks:
        if not ok:
            raise HookPointError(f"SGLang has no {name} as the moespec plugin expects "
                                 f"(it hooks SGLang {SGLANG_VERSION})")


def check_eagle_target_hook_point() -> None:
    """Raises HookPointError unless the EAGLE target hook point is there, called as embed_head.py expects."""
    _check_signature(TARGET_EMBED_AND_HEAD, ["target_model"], "target_model, ...", leading=True)


def check_step_pin_hook_points() -> None:
    """Raises HookPointError unless the step pin's three hook points are there, called as step_pin.py expects."""
    for name, parameters in STEP_PIN_SIGNATURES.items():
        _check_signature(name, parameters, ", ".join(parameters[1:]))


def check_tree_ranking_hook_point() -> None:
    """Raises HookPointError unless the draft-probability hook point is there, called as tree_ranking.py expects."""
    _check_signature(DRAFT_PROBS, DRAFT_PROBS_PARAMETERS, ", ".join(DRAFT_PROBS_PARAMETERS))


def _check_signature(name: str, parameters: list[str], shown: str, leading: bool = False) -> None:
    """The function at dotted path `name` takes `parameters` (with `leading`: as its first ones); HookPointError
    naming it as `name(shown)` otherwise."""
    try:
        function = pkgutil.resolve_name(name)
    except (ImportError, AttributeError) as e:
        raise HookPointError(f"{e} (the moespec plugin hooks SGLang {SGLANG_VERSION})") from None
    got = list(inspect.signature(function).parameters)
    if (got[:len(parameters)] if leading else got) != parameters:
        raise HookPointError(f"SGLang has no {name}({shown}) as the moespec plugin expects "
                             f"(it hooks SGLang {SGLANG_VERSION})")
