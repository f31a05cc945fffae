"""The embedded engine: a Qwen2-MoE target and its draft (a draft head or a dense draft model) on
PyTorch, speculative decoding,
and per-layer expert unions of every verification pass.

Contract:
- `generate(request, policy)` returns a GenerationResult whose tokens follow the target's
  distribution under the request's sampling for any policy: greedy output is identical to plain
  decoding, sampled output is distributed exactly as the target's (see `sampling.accept`).
- Every step is one target pass over a window [last committed token, drafts...]; plain decoding
  is the same step with no drafts (window 1). Each step yields one StepRecord with the drafted,
  accepted and committed counts, the distinct routed experts per layer over the whole window
  (rejected drafts included), and draft / verify wall time.
- Structure: the engine loads the models and builds one `Runtime` (runtime.py: models, caches,
  features, adaptive state, step clock, record settings); the scheduler decides what runs, the model
  runner (model_runner.py) runs it on that runtime, and the engine itself only validates requests.
- Continuous batching: `generate` blocks its caller while one scheduler thread (`scheduler.py`)
  runs every request in flight, up to `max_batch` at once, each verify step one target pass over the
  windows of all of them, with newcomers' prompts chunked into those passes (`prefill_chunk` prompt
  tokens per pass); a request's tokens for a fixed seed do not depend on what else runs.
  `should_stop` is polled once per step; `on_delta` receives text as it becomes final (never text a
  stop string later removes), called from the scheduler thread.
"""

from __future__ import annotations

import functools
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from service.engine.kernels.library import build as build_kernels
from service.engine.kernels.packed import MATHS
from service.engine.kernels.pool import ONE_THREAD, KernelPool, KernelThreads
from service.engine.model.draft_head import DraftHead, is_head_dir, load_head
from service.engine.model.eagle3 import Eagle3Draft, check_aux_layer_ids, is_eagle3_dir, load_eagle3
from service.engine.model.layers import KERNEL_WINDOW_MAX
from service.engine.model.ragged import KVCache
from service.engine.model.weights import DEFAULT_HEAD_DIR, DEFAULT_TARGET_DIR, load_for_inference
from service.engine.runtime import Runtime, StepClock
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence
from service.engine.spec.adaptive.state import AdaptiveState
from service.engine.spec.tree_calibration import (
    calibration_texts,
    eagle3_greedy_temperature,
    head_greedy_temperature,
)
from service.engine.step_records import StepRecords
from service.engine.threads import usable_cores
from service.engine_defaults import MAX_BATCH, PREFILL_CHUNK, STEPS_PER_CALL
from service.limits import PromptLimits, tokenizer_prompt_bytes
from service.recording import StepRecorder
from service.routing import expert_parallel
from service.types import (
    MAX_DRAFT_LENGTH,
    MAX_TREE_WIDTH,
    Controller,
    Drafter,
    DraftPolicy,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    ModelInfo,
    StreamDelta,
    new_token_budget,
)

__all__ = ["Engine", "EngineConfig"]


class MathUnavailable(ValueError):
    """The asked arithmetic cannot run here (no kernels, or no AMX tile unit)."""


@dataclass(frozen=True)
class EngineConfig:
    target_dir: Path = DEFAULT_TARGET_DIR
    # The model drafter: a draft head (model/draft_head.py, the default) or a dense draft model directory
    # (models/draft); None: only the n-gram drafter is offered.
    draft_dir: Path | None = DEFAULT_HEAD_DIR
    max_context: int | None = None  # default: the target's max_position_embeddings
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Threads the fused kernels split a pass's work over (KernelThreads says from how many positions on;
    # a decode step of one request splits only its output layer); None: every usable core.
    kernel_threads: int | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    capture_topk: bool = False  # keep [L, w, m] routed ids in every StepRecord
    capture_routing: bool = True  # count unique experts (off only to measure its overhead)
    fast_step: bool = True  # fused kernels (kernels/library.py); False: the eager torch step, to compare against
    # The fast step's matrix products: "fp32", "bf16" (inputs rounded to bf16, float32 sums: the
    # target's logits move a little, less than in transformers' own bf16 run) or "amx" (the same
    # rounding, the AMX tile unit's sums); None: amx where the CPU and kernel offer the tiles, else bf16
    # where the CPU multiplies bf16 pairs markedly faster than float32 (measured at start-up), else fp32
    # (Kernels.default_math). Attention, norms, routing and
    # the draft model stay float32.
    math: str | None = None
    fused_attention: bool = True  # with fast_step: attention in one kernel call per layer; False: eager, to compare
    kernel_window_max: int = KERNEL_WINDOW_MAX  # largest pass whose MoE blocks take the fused kernel
    ep: expert_parallel.EPSpec | None = None  # estimate each pass's expert-parallel cost for this EP size
    record_steps: Path | None = None  # append every request's steps (top-k ids included) to this file
    max_batch: int = MAX_BATCH  # requests verified together in one pass (KV-cache slots); more wait
    prefill_chunk: int = PREFILL_CHUNK  # newcomers' prompt tokens per pass (chunked prefill; engine_defaults)
    # Greedy steps one kernel call may run back to back when nobody waits to join: plain steps, and a lone
    # request's draft-head chain at draft temperature 0 (1: a call per step)
    steps_per_call: int = STEPS_PER_CALL


class Engine:
    backend_name = "torch"

    def __init__(self, config: EngineConfig = EngineConfig()):
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        kernels = build_kernels() if config.fast_step else None  # None also when no C compiler is found
        self.step_kind = "fast" if kernels else "reference"
        if config.math not in (None, *MATHS):
            raise ValueError(f"math must be one of {MATHS} or None, got {config.math!r}")
        if config.math in ("bf16", "amx") and not kernels:
            raise MathUnavailable(f"math={config.math!r} needs the fast step's kernels (fast_step and a C compiler)")
        if config.math == "amx" and not kernels.amx_native:
            raise MathUnavailable("math='amx' needs the AMX tile unit: this CPU or its kernel offers none "
                                  "(math='bf16' runs the same rounding on the vector units)")
        self.math = (config.math or kernels.default_math()) if kernels else "fp32"  # the eager step: float32
        if config.kernel_threads is not None and config.kernel_threads < 1:
            raise ValueError(f"kernel_threads must be >= 1, got {config.kernel_threads}")
        threads = config.kernel_threads or usable_cores()
        self.kernel_threads = KernelThreads(kernels.pool(threads)) if kernels and threads > 1 else ONE_THREAD
        self.target = load_for_inference(config.target_dir, kernels=kernels, kernel_window_max=config.kernel_window_max,
                                         fused_attention=config.fused_attention, kernel_threads=self.kernel_threads,
                                         math=self.math)
        draft_is_head = bool(config.draft_dir) and is_head_dir(config.draft_dir)
        draft_is_eagle3 = bool(config.draft_dir) and is_eagle3_dir(config.draft_dir)
        if draft_is_head:
            self.draft = load_head(config.draft_dir, kernels=kernels, kernel_threads=self.kernel_threads)
        elif draft_is_eagle3:
            self.draft = load_eagle3(config.draft_dir)
        else:
            self.draft = load_for_inference(config.draft_dir, kernels=kernels, fused_attention=config.fused_attention,
                                            kernel_threads=self.kernel_threads) if config.draft_dir else None
        self.tokenizer = Tokenizer.from_file(str(Path(config.target_dir) / "tokenizer.json"))
        cfg = self.target.cfg
        if not cfg.is_moe:
            raise ValueError(f"{config.target_dir}: the target must be a qwen2_moe model")
        if self.draft is not None and (self.draft.target_vocab if draft_is_head
                                       else self.draft.cfg.vocab_size) != cfg.vocab_size:
            raise ValueError("draft and target vocabularies differ")
        if draft_is_head and self.draft.cfg.hidden_size != cfg.hidden_size:
            raise ValueError(f"{config.draft_dir}: the draft head's hidden size differs from the target's")
        if draft_is_eagle3:
            if self.draft.cfg.target_hidden_size != cfg.hidden_size or self.draft.cfg.hidden_size != cfg.hidden_size:
                raise ValueError(f"{config.draft_dir}: the EAGLE-3 draft's hidden sizes differ from the target's "
                                 "(it embeds with the target's table)")
            try:
                check_aux_layer_ids(self.draft.cfg.aux_layer_ids, cfg.num_hidden_layers)
            except ValueError as error:
                raise ValueError(f"{config.draft_dir}: {error}") from None
        self.max_context = min(config.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
        # Static caches, one slot per batch place, sized for the context; a window never writes past it.
        target_cache = KVCache(cfg, self.max_context, slots=config.max_batch)
        draft_cache = (self.draft.new_cache(self.max_context, slots=config.max_batch) if draft_is_eagle3
                       else KVCache(self.draft.cfg, self.max_context, slots=config.max_batch) if self.draft else None)
        self.decode_step_seconds = self._calibrate_decode_step(target_cache)
        # (before the scheduler starts: the target cache's slots are scratch here)
        tree_tau = 1.0
        if (draft_is_head or draft_is_eagle3) and self.target.fused_attention:  # the drafts that grow trees
            fit = head_greedy_temperature if draft_is_head else eagle3_greedy_temperature
            tree_tau = fit(self.target, self.draft, target_cache, calibration_texts(self.tokenizer, self.max_context))
        self.info = self._model_info()
        # What the server checks before any work (service/limits.py): context and prompt bytes.
        self.prompt_limits = PromptLimits(self.max_context, tokenizer_prompt_bytes(self.tokenizer, self.max_context),
                                          cfg.vocab_size)
        ep = (expert_parallel.make_placement(config.ep.size, cfg.num_hidden_layers, cfg.num_experts,
                                             config.ep.physical_to_logical) if config.ep else None)
        self.recorder = StepRecorder(config.record_steps, self.info, cfg.hidden_size) if config.record_steps else None
        self.max_batch = config.max_batch  # the Backend protocol's batch slots: the server runs this many callers
        self.runtime = Runtime(
            target=self.target,
            target_cache=target_cache,
            draft=self.draft,
            draft_cache=draft_cache,
            target_features=(torch.zeros(config.max_batch, self.max_context, cfg.hidden_size)
                             if draft_is_head else
                             torch.zeros(config.max_batch, self.max_context, self.draft.fc.in_features)
                             if draft_is_eagle3 else None),
            head_chain=(self.draft.chain_weights(self.target.embed_tokens.weight, draft_cache)
                        if draft_is_head else None),
            tree_greedy_tau=tree_tau,
            adaptive=AdaptiveState(cfg.num_experts, cfg.num_experts_per_tok, self.decode_step_seconds),
            clock=StepClock(self.decode_step_seconds),
            records=StepRecords(cfg.num_experts, cfg.num_experts_per_tok, count_routing=config.capture_routing,
                                keep_topk=config.capture_topk or self.recorder is not None, ep=ep,
                                ep_token_bytes=cfg.hidden_size * config.ep.dtype_bytes if config.ep else 0),
            ngram_sizes=(config.ngram_min, config.ngram_max),
            eos_id=cfg.eos_token_id,
            # The tokenizer's, not a method of the engine: the scheduler thread must not keep the engine alive.
            decode=functools.partial(self.tokenizer.decode, skip_special_tokens=True),
            sampler=self.target.kernels,
        )
        # The scheduler owns the models from here on.
        self._scheduler = Scheduler(self.runtime, config.max_batch, config.prefill_chunk, config.steps_per_call)
        # Stop the scheduler thread (then the kernels' workers, which it calls) when the engine is collected
        # or the interpreter exits, if nobody called close() (a thread still parked in torch at exit aborts
        # the process).
        self._finalizer = weakref.finalize(self, _shut_down, self._scheduler, self.kernel_threads.pool)

    # ----------------------------------------------------------------- public API
    def generate(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> GenerationResult:
        request.validate(self.info.vocab_size, self.max_context)
        policy.validate(MAX_DRAFT_LENGTH)
        for where, part in policy.parts():
            if part.draft_length and part.drafter is Drafter.MODEL and self.draft is None:
                raise InvalidRequest(f"{where}.drafter", "this engine has no draft model; use the n-gram drafter")
            if part.tree_width > self.info.max_tree_width:
                raise InvalidRequest(f"{where}.tree_width", f"this engine drafts trees up to width "
                                     f"{self.info.max_tree_width}: {self._trees_note()}")
        prompt = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt).ids
        if not prompt:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
        if len(prompt) >= self.max_context:
            raise InvalidRequest("prompt", f"{len(prompt)} tokens; the context holds {self.max_context} "
                                           "including at least one new token")
        budget = new_token_budget(request.max_new_tokens, len(prompt), self.max_context)
        result = self._scheduler.submit(Sequence(request, policy, prompt, budget, should_stop, on_delta))
        if self.recorder is not None:
            self.recorder.write(result.steps)  # never raises: a full disk loses the recording, not the request
        return result

    def close(self) -> None:
        """Requests still running or waiting end CANCELLED; the scheduler thread and the kernels' workers exit."""
        self._finalizer()
        if self.recorder is not None:
            self.recorder.close()

    def decode(self, ids: list[int]) -> str:
        return self.runtime.decode(ids)

    # ------------------------------------------------------------- start-up
    def _calibrate_decode_step(self, cache: KVCache, steps: int = 24) -> float:
        """Median wall time of a plain decode step: the unit of `decode_step_equivalents`."""
        prompt = torch.tensor(self.tokenizer.encode("def main():\n    return 0\n").ids)
        times = []
        with torch.inference_mode():
            # Before the scheduler starts, so slot 0 is free to use.
            logits = self.target.forward(prompt, 0, cache).logits
            token = logits[-1:].argmax(-1)
            for i in range(steps):
                t0 = time.perf_counter()
                logits = self.target.forward(token, prompt.shape[0] + i, cache).logits
                token = logits.argmax(-1)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[steps // 3:])

    def _model_info(self) -> ModelInfo:
        cfg = self.target.cfg
        drafters = (Drafter.MODEL, Drafter.NGRAM) if self.draft else (Drafter.NGRAM,)
        tunable = ("drafter", "draft_length", "draft_temperature") if self.draft else ("drafter", "draft_length")
        trees = self._trees_note() == ""
        tunable += ("tree_width",) if trees else ()
        bytes_per_param = 2  # bf16 on disk: the weight traffic a real deployment would move
        return ModelInfo(
            backend=self.backend_name,
            model_name=Path(self.config.target_dir).name,
            draft_model_name=Path(self.config.draft_dir).name if self.draft else "",
            num_layers=cfg.num_hidden_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            shared_experts=1,
            vocab_size=cfg.vocab_size,
            max_context=self.max_context,
            max_draft_length=MAX_DRAFT_LENGTH,
            drafters=drafters,
            tunable=tunable,
            expert_bytes=3 * cfg.hidden_size * cfg.moe_intermediate_size * bytes_per_param,
            decode_step_seconds=self.decode_step_seconds,
            concurrent_policies=True,  # the policy is a per-call argument: any mix of arms at once
            device="cpu",  # the fused kernels and the torch fallbacks run on the CPU only
            shared_passes=self.config.max_batch > 1,  # continuous batching: one target pass serves them all
            controllers=tuple(Controller),  # every controller runs per request in the scheduler
            policy_tables=True,  # the scheduler picks each step's cell
            max_tree_width=MAX_TREE_WIDTH if trees else 1,
        )

    def _trees_note(self) -> str:
        """Why this engine drafts chains only ("" where it drafts trees): trees grow with the draft head or
        an EAGLE-3 draft and are verified by the fused attention kernel (kernels/attention.py)."""
        if not isinstance(self.draft, DraftHead | Eagle3Draft):
            return "draft trees need a draft head or an EAGLE-3 draft as the model drafter"
        if not self.target.fused_attention:
            return "draft trees need the fused attention kernel (fast_step, fused_attention and a C compiler)"
        return ""


def _shut_down(scheduler: Scheduler, pool: KernelPool | None) -> None:
    scheduler.close()  # after this no kernel call runs, so the pool can go
    if pool is not None:
        pool.close()
