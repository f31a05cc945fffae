"""The draft step count, set by moespec at run time instead of by SGLang's acceptance rule.

SGLang 0.5.23's `--speculative-adaptive` (EAGLE/EAGLE3, topk 1) builds one runtime state per
candidate step count at start-up and, before every batch, activates the one its policy object
(`AdaptiveSpeculativeParams`) names: a pointer swap, no restart. Its own rule moves the count by an
acceptance EMA, which would fight moespec's tuner. With this part switched on (wire.STEP_PIN_ENV):
- the rule never moves the count (`on_verify_complete` reports no change), so the engine stays at
  the step count it started with until moespec pins another;
- moespec pins one through `Engine.collective_rpc(PIN_METHOD, steps=n)`, which SGLang delivers to
  every scheduler rank between batches; the next batch runs at n.
Requests in flight are not a concern here: the backend drains them before it pins (swap_gate.py),
so every request runs at one step count from its first verify pass to its last.
"""

from __future__ import annotations

from service.sglang_plugin.wire import PIN_METHOD

PIN_ATTRIBUTE = "_moespec_pinned_steps"  # set on SGLang's AdaptiveSpeculativeParams of this scheduler


def get_steps_for_batch(original, params, batch_size):
    """AROUND hook of AdaptiveSpeculativeParams.get_steps_for_batch: the pinned count, else SGLang's
    (which, with the rule below switched off, is the count the engine started with)."""
    pinned = getattr(params, PIN_ATTRIBUTE, None)
    return original(params, batch_size) if pinned is None else pinned


def on_verify_complete(original, params, num_correct_drafts_per_req, batch_size):
    """AROUND hook of AdaptiveSpeculativeParams.on_verify_complete: never a switch of SGLang's choosing."""
    return None


def handle_rpc_request(original, scheduler, recv_req):
    """AROUND hook of Scheduler.handle_rpc_request: answers PIN_METHOD, passes every other call on."""
    if recv_req.method != PIN_METHOD:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import RpcReqOutput
    from torch.distributed import barrier

    message = _pin(scheduler, (recv_req.parameters or {}).get("steps"))
    barrier(group=scheduler.tp_group.cpu_group)  # as SGLang's own handler: every rank pinned before the reply
    return RpcReqOutput(success=not message, message=message)


def _pin(scheduler, steps) -> str:
    """Pins this rank's step count; returns why not ("" = pinned)."""
    controller = getattr(getattr(scheduler, "draft_worker", None), "adaptive_controller", None)
    if controller is None:
        return "this engine runs no adaptive speculative states (start it with speculative_adaptive)"
    if steps not in controller.candidate_steps:
        return f"steps={steps!r} is not a prepared step count {controller.candidate_steps}"
    setattr(controller.params, PIN_ATTRIBUTE, steps)
    return ""
