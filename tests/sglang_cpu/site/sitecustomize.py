"""Post-import patches that let a real SGLang 0.5.23 run on this CPU (test support only).

TIES THE TESTS TO sglang==0.5.23. Python imports `sitecustomize` at start-up in every process whose
PYTHONPATH holds this directory: the `sglang_cpu` tests put it there for the `moespec serve`
processes they start (and SGLang's scheduler / detokenizer subprocesses inherit it). The product
never imports this. Beside it, `sgl_kernel/` stands in for the sgl-kernel CPU ops (see its docstring).

The patches, each applied right after its SGLang module is imported (an import hook, so nothing is
imported early and processes that never load SGLang are untouched):
1. srt/models/qwen2_moe.py: the shared-expert gate (`sigmoid(x . w) * shared_out`, optionally added
   to the routed output) is a Triton kernel even on CPU ("0 active drivers"); on CPU tensors it is
   computed in torch instead.
2. srt/arg_groups/overrides.py: `_attention_backend_platform_fallbacks` rewrites
   attention_backend=intel_amx to torch_native when it sees no AMX kernels (it looks for
   `convert_weight_packed`, deliberately absent). torch_native cannot verify drafts
   (extend_prefix_lens is None in TARGET_VERIFY), so on CPU the intel_amx choice is kept; its two
   attention kernels are the stand-ins registered by `sgl_kernel/attention.py`.
3. The intel_amx attention kernels themselves: `torch.ops.sgl_kernel.{decode,extend}_attention_cpu`,
   registered when `import sgl_kernel` runs (which intel_amx_backend.py does before using them).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _patch_qwen2_moe(module) -> None:
    import torch

    original_mul, original_mul_add = module.fused_gate_sigmoid_mul, module.fused_gate_sigmoid_mul_add

    def gated(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1, 1))  # [T, 1]
        return gate * shared_output.float()

    def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
        if hidden_states.device.type != "cpu":
            return original_mul(hidden_states, gate_weight, shared_output)
        return gated(hidden_states, gate_weight, shared_output).to(shared_output.dtype)

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        if hidden_states.device.type != "cpu":
            return original_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states)
        total = final_hidden_states.float() + gated(hidden_states, gate_weight, shared_output)
        final_hidden_states.copy_(total.to(final_hidden_states.dtype))
        return None

    module.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
    module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add


def _patch_overrides(module) -> None:
    original = module._attention_backend_platform_fallbacks

    def keep_intel_amx_on_cpu(view) -> dict:
        decided = original(view)
        if view.device == "cpu" and view.attention_backend == "intel_amx":
            decided = {k: v for k, v in decided.items() if k != "attention_backend"}
        return decided

    passes = module.POST_PROCESS_PASSES
    passes[passes.index(original)] = keep_intel_amx_on_cpu
    module._attention_backend_platform_fallbacks = keep_intel_amx_on_cpu


PATCHES = {
    "sglang.srt.models.qwen2_moe": _patch_qwen2_moe,
    "sglang.srt.arg_groups.overrides": _patch_overrides,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the normal path finder, then patches them once executed."""

    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
