"""moespec GenerationRequest -> SGLang 0.5.23 `sampling_params` dict.

Names from python/sglang/srt/sampling/sampling_params.py (SamplingParams): temperature, top_p,
top_k (SGLang's "off" is TOP_K_ALL = 1 << 30, so it is simply left out), max_new_tokens, stop,
sampling_seed (per request).
"""

from __future__ import annotations

from service.types import GenerationRequest


def sampling_params(request: GenerationRequest, greedy: bool = False) -> dict:
    s = request.sampling
    out: dict = {
        "max_new_tokens": request.max_new_tokens,
        "temperature": 0.0 if greedy else s.temperature,
        "top_p": s.top_p,
    }
    if s.top_k > 0:
        out["top_k"] = s.top_k
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    if request.stop:
        out["stop"] = list(request.stop)
    return out
