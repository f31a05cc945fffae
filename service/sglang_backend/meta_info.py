"""The parts of an SGLang 0.5.23 `meta_info` dict this backend reads.

Source: python/sglang/srt/managers/tokenizer_manager.py, `_calculate_spec_decoding_metrics`
(called only for a finished request while a speculative algorithm is set, and only when
spec_verify_ct > 0):
    spec_verify_ct            verify passes of the request (prefill not counted)
    spec_num_correct_drafts   drafts accepted over all passes (bonus tokens not counted)
    spec_num_proposed_drafts  spec_verify_ct * (speculative_num_draft_tokens - 1)
    spec_accept_rate          spec_num_correct_drafts / spec_num_proposed_drafts
    spec_accept_length        completion_tokens / spec_verify_ct (includes the prefill's token)
    spec_correct_drafts_histogram  list: [a] = passes that accepted exactly a drafts
                              (Req.update_spec_correct_drafts_histogram, managers/schedule_batch.py)
Always present: finish_reason ({"type": "stop"|"length"|"abort", ...} or None; a stream ends with an
"abort" chunk carrying status_code and message, see _handle_abort_finish_reason), prompt_tokens,
completion_tokens, e2e_latency (finished requests).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.types import FinishReason, InvalidRequest


@dataclass(frozen=True)
class SpecMeta:
    verify_ct: int
    correct_drafts: int
    proposed_drafts: int
    accept_length: float
    histogram: tuple[int, ...]  # [a] passes with exactly a accepted drafts

    @classmethod
    def from_meta_info(cls, meta: dict) -> SpecMeta | None:
        """None when the request ran without speculation (or finished before any verify pass)."""
        if not meta.get("spec_verify_ct"):
            return None
        return cls(
            verify_ct=int(meta["spec_verify_ct"]),
            correct_drafts=int(meta.get("spec_num_correct_drafts", 0)),
            proposed_drafts=int(meta.get("spec_num_proposed_drafts", 0)),
            accept_length=float(meta.get("spec_accept_length", 0.0)),
            histogram=tuple(int(x) for x in meta.get("spec_correct_drafts_histogram") or ()),
        )

    def accepted_per_position(self, draft_length: int) -> tuple[int, ...]:
        """[k] passes whose draft i was accepted: on a chain, those that accepted more than i drafts."""
        return tuple(sum(self.histogram[i + 1:]) for i in range(draft_length))


class EngineAborted(RuntimeError):
    """SGLang aborted a request nobody cancelled (bad input it refused, or an engine fault)."""


def finish_reason(meta: dict, cancelled: bool) -> FinishReason:
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if cancelled:
        return FinishReason.CANCELLED
    if kind == "abort":
        message = reason.get("message", reason) if isinstance(reason, dict) else reason
        if isinstance(reason, dict) and reason.get("status_code") == 400:
            # SGLang refused the input (e.g. longer than its context): the caller's fault.
            raise InvalidRequest("prompt", f"sglang refused it: {message}")
        raise EngineAborted(f"sglang aborted the request: {message}")
    if kind == "length":
        return FinishReason.LENGTH
    return FinishReason.STOP
