"""Where SGLang computes: the engine arguments and environment each device needs.

CUDA is the default and needs nothing extra. `--device cpu` is an opt-in for machines without a
GPU (CI here): SGLang 0.5.23 has a CPU mode, switched on by SGLANG_USE_CPU_ENGINE=1, which its
modules read *when they are imported* (so it is set before `import sglang`), and which needs
sgl-kernel's CPU ops (a source build; the tests stand in for them, tests/sglang_cpu/).
The CPU settings below are what ran the shipped model on a 2-core CI machine:
- no CUDA graphs (decode or prefill);
- attention_backend intel_amx: the CPU backend that can verify drafts (torch_native cannot:
  its TARGET_VERIFY path has no prefix lengths);
- mem_fraction_static is a share of the whole machine's RAM on CPU: 0.3, and max_total_tokens
  4096 bounds the KV pool instead; chunked prefill 256 (the per_token recorder sizes its per-pass
  buffer as chunked_prefill_size * 8 tokens, so smaller is cheaper);
- TORCHDYNAMO_DISABLE=1 (unless set): otherwise the first STANDALONE request spends ~55 s in an
  inductor compile of the draft step.
Every value yields to the operator's own flag (--sglang-mem-fraction, --sglang-chunked-prefill,
--sglang-arg KEY=VALUE).
"""

from __future__ import annotations

CUDA, CPU = "cuda", "cpu"
DEVICES = (CUDA, CPU)

_CPU_ENGINE_KWARGS = {
    "device": CPU,
    "attention_backend": "intel_amx",
    "disable_decode_cuda_graph": True,
    "disable_prefill_cuda_graph": True,
    "mem_fraction_static": 0.3,
    "max_total_tokens": 4096,
}
_CHUNKED_PREFILL = {CUDA: 4096, CPU: 256}


def engine_kwargs(device: str) -> dict:
    """sglang.Engine arguments this device needs (before the operator's own)."""
    return dict(_CPU_ENGINE_KWARGS) if device == CPU else {}


def chunked_prefill(device: str) -> int:
    return _CHUNKED_PREFILL[device]


def environment(device: str, current: dict[str, str]) -> dict[str, str]:
    """Variables to set before `import sglang` (the scheduler subprocesses inherit them)."""
    if device != CPU:
        return {}
    out = {"SGLANG_USE_CPU_ENGINE": "1"}
    if "TORCHDYNAMO_DISABLE" not in current:
        out["TORCHDYNAMO_DISABLE"] = "1"
    return out
