"""moespec's SGLang plugin: the code that runs inside SGLang's scheduler process.

SGLang loads `load` from the `sglang.srt.plugins` entry point first thing in every scheduler
process. It does nothing unless the moespec backend switched a part of it on for that engine (an
environment variable the scheduler inherits, named in wire.py), so a user's other SGLang servers in
the same environment are untouched. Three independent parts:
- the tap (wire.TAP_ENV): two hooks (hook_points.py) that measure every target pass (tap.py,
  statistics.py) and push one record per pass to the moespec server (sender.py). What crosses the
  process boundary, and in which format, is written in wire.py alone; the server side reads it in
  service/sglang_backend/stats_channel.py;
- the EAGLE target (wire.EAGLE_TARGET_ENV): one hook that gives a Qwen2-MoE target the embedding/head
  lookup an EAGLE/EAGLE-3 draft needs (embed_head.py);
- the step pin (wire.STEP_PIN_ENV): three hooks that let moespec set an adaptive EAGLE engine's draft
  step count at run time, and keep SGLang's own acceptance rule from moving it (step_pin.py);
- the tree ranking (wire.TREE_TAU_ENV): one hook that ranks an EAGLE tree's candidates at a temperature
  (tree_ranking.py).
"""

from __future__ import annotations

import os


def load() -> None:
    """The entry point: inert without wire.TAP_ENV, wire.EAGLE_TARGET_ENV, wire.STEP_PIN_ENV and
    wire.TREE_TAU_ENV."""
    from service.sglang_plugin import wire

    config = wire.TapConfig.from_env(os.environ.get(wire.TAP_ENV))
    eagle_target = os.environ.get(wire.EAGLE_TARGET_ENV) == "1"
    step_pin = os.environ.get(wire.STEP_PIN_ENV) == "1"
    tree_tau = os.environ.get(wire.TREE_TAU_ENV)
    if config is None and not eagle_target and not step_pin and not tree_tau:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from service.sglang_plugin import hook_points

    if eagle_target:
        from service.sglang_plugin.embed_head import resolve_target_embed_and_head

        HookRegistry.register(hook_points.TARGET_EMBED_AND_HEAD, resolve_target_embed_and_head, HookType.AROUND)
    if step_pin:
        from service.sglang_plugin import step_pin as pin

        HookRegistry.register(hook_points.ADAPTIVE_STEPS_FOR_BATCH, pin.get_steps_for_batch, HookType.AROUND)
        HookRegistry.register(hook_points.ADAPTIVE_VERIFY_COMPLETE, pin.on_verify_complete, HookType.AROUND)
        HookRegistry.register(hook_points.SCHEDULER_RPC, pin.handle_rpc_request, HookType.AROUND)
    if tree_tau:
        from service.sglang_plugin.tree_ranking import ranked_draft_probs

        HookRegistry.register(hook_points.DRAFT_PROBS, ranked_draft_probs(float(tree_tau)), HookType.AROUND)
    if config is not None:
        from service.sglang_plugin.tap import TapState

        state = TapState(config)
        HookRegistry.register(hook_points.RECORDER_FACTORY, state.wrap_recorder, HookType.AFTER)
        HookRegistry.register(hook_points.MODEL_FORWARD, state.around_forward, HookType.AROUND)
