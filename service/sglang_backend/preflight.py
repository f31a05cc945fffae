"""Checks that run before SGLang starts, each failing with one line that says what to do.

Order (create_backend): arguments and model directories first (cheap, and the most likely mistake),
then the sglang import, then CUDA. Every failure is a service.errors.UsageError, so `moespec serve`
exits 2 with the reason instead of a traceback from deep inside SGLang's subprocesses.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from types import ModuleType

from service.errors import UsageError
from service.sglang_backend.model_config import ModelDirError, MoeGeometry, dense_name, moe_geometry
from service.sglang_backend.records import RECORDER_TOPK_WIDTH

log = logging.getLogger(__name__)

PINNED_VERSION = "0.5.23"
INSTALL_HINT = "pip install '.[sglang]' (from a moespec checkout) or pip install 'moespec[sglang]'"


class SGLangUnavailable(UsageError):
    """SGLang or a CUDA GPU is missing on this machine."""


def import_sglang() -> ModuleType:
    """The real `import sglang`; its ImportError becomes an install hint."""
    try:
        module = importlib.import_module("sglang")
    except ImportError as e:
        raise SGLangUnavailable(
            f"--backend sglang needs SGLang {PINNED_VERSION} ({e}); install it with {INSTALL_HINT}"
        ) from e
    version = getattr(module, "__version__", "unknown")
    if version != PINNED_VERSION:
        # The recorder's per_token format is read from 0.5.23's source; other versions may differ.
        log.warning("sglang %s is installed; moespec reads the recorder format of %s", version, PINNED_VERSION)
    return module


CPU_KERNELS = "sgl_kernel"  # SGLang's compiled ops; it publishes no CPU build of them


def require_cpu_kernels(find_spec=importlib.util.find_spec) -> None:
    """--device cpu: SGLang's CPU mode calls sgl_kernel's CPU ops, which no SGLang release ships for
    CPUs; without them the server would die deep inside SGLang's start-up with a traceback."""
    if find_spec(CPU_KERNELS) is None:
        raise SGLangUnavailable(
            f"--backend sglang --device cpu needs {CPU_KERNELS}'s CPU ops, which SGLang does not publish "
            "(the stand-ins under tests/sglang_cpu are for the tests only); use --backend torch on a CPU"
        )


def require_cuda() -> None:
    import torch  # a base dependency; imported here so that merely importing this module stays cheap

    if not torch.cuda.is_available():
        raise SGLangUnavailable(
            "--backend sglang needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); "
            "use --backend torch on this machine"
        )


def check_target(path: Path | None) -> MoeGeometry:
    if path is None:
        raise UsageError("--backend sglang needs --model-path (a local MoE model directory)")
    try:
        geometry = moe_geometry(path)
    except ModelDirError as e:
        raise UsageError(f"--model-path {e}") from None
    if geometry.top_k > RECORDER_TOPK_WIDTH:
        raise UsageError(f"--model-path {path}: top-{geometry.top_k} routing; SGLang's per_token expert recorder "
                         f"holds {RECORDER_TOPK_WIDTH} ids per token")
    return geometry


def check_draft(path: Path | None, algorithm: str | None, needs_path: tuple[str, ...]) -> str:
    if path is None:
        if algorithm in needs_path:
            raise UsageError(f"--speculative-algorithm {algorithm} needs --draft-model-path")
        return ""
    try:
        return dense_name(path)
    except ModelDirError as e:
        raise UsageError(f"--draft-model-path {e}") from None


def check_plugin_hooks() -> None:
    """The SGLang names moespec's plugin hooks exist in this install (the scheduler runs the same one)."""
    from service.sglang_plugin.hook_points import HookPointError, check_hook_points

    try:
        check_hook_points()
    except HookPointError as e:
        raise SGLangUnavailable(f"--backend sglang: {e}; run with --sglang-no-expert-record to serve without "
                                "routing statistics") from None


def check_eagle_target_hook() -> None:
    """EAGLE/EAGLE3: the hook point through which the plugin gives a Qwen2-MoE target the embedding/head
    lookup the draft needs exists in this install (service/sglang_plugin/embed_head.py)."""
    from service.sglang_plugin.hook_points import HookPointError, check_eagle_target_hook_point

    try:
        check_eagle_target_hook_point()
    except HookPointError as e:
        raise SGLangUnavailable(f"--backend sglang --speculative-algorithm EAGLE/EAGLE3: {e}") from None


def check_step_pin_hooks() -> None:
    """Prepared draft lengths: the hook points through which the plugin pins an adaptive EAGLE engine's
    step count exist in this install (service/sglang_plugin/step_pin.py)."""
    from service.sglang_plugin.hook_points import HookPointError, check_step_pin_hook_points

    try:
        check_step_pin_hook_points()
    except HookPointError as e:
        raise SGLangUnavailable(f"--sglang-prepared-lengths: {e}; pass --sglang-prepared-lengths none to change "
                                "draft lengths by engine restarts") from None


def check_tree_ranking_hook() -> None:
    """--sglang-tree-temperature: the hook point through which the plugin ranks EAGLE tree candidates at a
    temperature exists in this install (service/sglang_plugin/tree_ranking.py)."""
    from service.sglang_plugin.hook_points import HookPointError, check_tree_ranking_hook_point

    try:
        check_tree_ranking_hook_point()
    except HookPointError as e:
        raise SGLangUnavailable(f"--sglang-tree-temperature: {e}; leave it out to rank trees as SGLang does") from None
