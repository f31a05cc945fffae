"""The embedded engine: a Qwen2-MoE target and a dense draft on PyTorch, speculative decoding,
and per-layer expert unions of every verification pass.

Contract:
- `generate(request, policy)` returns a GenerationResult whose tokens follow the target's
  distribution under the request's sampling for any policy: greedy output is identical to plain
  decoding, sampled output is distributed exactly as the target's (see `sampling.accept`).
- Every step is one target pass over a window [last committed token, drafts...]; plain decoding
  is the same step with no drafts (window 1). Each step yields one StepRecord with the drafted,
  accepted and committed counts, the distinct routed experts per layer over the whole window
  (rejected drafts included), and draft / verify wall time.
- One request runs at a time (a lock); concurrent callers queue. `should_stop` is polled once per
  step; `on_delta` receives text as it becomes final (never text a stop string later removes).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from service import expert_parallel
from service.engine import ngram
from service.engine.kernels import build as build_kernels
from service.engine.model import KVCache
from service.engine.sampling import accept, accept_greedy, draft_probs, point_mass, sample, target_probs
from service.engine.weights import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, load_for_inference
from service.recording import StepRecorder
from service.types import (
    MAX_DRAFT_LENGTH,
    Drafter,
    DraftPolicy,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    ModelInfo,
    SpecStats,
    StepRecord,
    StreamDelta,
)


@dataclass(frozen=True)
class EngineConfig:
    target_dir: Path = DEFAULT_TARGET_DIR
    draft_dir: Path | None = DEFAULT_DRAFT_DIR  # None: only the n-gram drafter is offered
    max_context: int | None = None  # default: the target's max_position_embeddings
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    ngram_min: int = 2
    ngram_max: int = 4
    capture_topk: bool = False  # keep [L, w, m] routed ids in every StepRecord
    capture_routing: bool = True  # count unique experts (off only to measure its overhead)
    fast_step: bool = True  # fused expert kernel (kernels.py); False: the previous eager step, to compare
    ep: expert_parallel.EPSpec | None = None  # estimate each pass's expert-parallel cost for this EP size
    record_steps: Path | None = None  # append every request's steps (top-k ids included) to this file


class Engine:
    backend_name = "torch"

    def __init__(self, config: EngineConfig = EngineConfig()):
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        kernels = build_kernels() if config.fast_step else None  # None also when no C compiler is found
        self.step_kind = "fast" if kernels else "reference"
        self.target = load_for_inference(config.target_dir, kernels=kernels)
        self.draft = load_for_inference(config.draft_dir, kernels=kernels) if config.draft_dir else None
        self.tokenizer = Tokenizer.from_file(str(Path(config.target_dir) / "tokenizer.json"))
        cfg = self.target.cfg
        if not cfg.is_moe:
            raise ValueError(f"{config.target_dir}: the target must be a qwen2_moe model")
        if self.draft is not None and self.draft.cfg.vocab_size != cfg.vocab_size:
            raise ValueError("draft and target vocabularies differ")
        self.max_context = min(config.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.eos_id = cfg.eos_token_id
        # Static caches sized for the context; a window never writes past max_context.
        self.target_cache = KVCache(cfg, self.max_context)
        self.draft_cache = KVCache(self.draft.cfg, self.max_context) if self.draft else None
        self._lock = threading.Lock()
        self.decode_step_seconds = self._calibrate_decode_step()
        # Recent plain (one-position) verify passes: the unit of decode_step_equivalents follows the
        # machine's current speed instead of the start-up calibration (which a busy CPU distorts).
        self._plain_steps: deque[float] = deque(maxlen=64)
        self.info = self._model_info()
        self.ep = (expert_parallel.make_placement(config.ep.size, cfg.num_hidden_layers, cfg.num_experts,
                                                  config.ep.physical_to_logical) if config.ep else None)
        self.ep_token_bytes = cfg.hidden_size * (config.ep.dtype_bytes if config.ep else 0)
        self.recorder = StepRecorder(config.record_steps, self.info, cfg.hidden_size) if config.record_steps else None

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
        if policy.draft_length and policy.drafter is Drafter.MODEL and self.draft is None:
            raise InvalidRequest("policy.drafter", "this engine has no draft model; use the n-gram drafter")
        prompt = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt).ids
        if not prompt:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
        if len(prompt) >= self.max_context:
            raise InvalidRequest("prompt", f"{len(prompt)} tokens; the context holds {self.max_context} "
                                           "including at least one new token")
        with self._lock, torch.inference_mode():
            result = _Generation(self, request, policy, prompt, should_stop, on_delta).run()
        if self.recorder is not None:
            self.recorder.write(result.steps)  # never raises: a full disk loses the recording, not the request
        return result

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------- engine internals
    def verify_window(self, window: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass: window [w] at positions start.. -> logits [w, V], routed ids [L, w, m]."""
        out = self.target.forward(window, start, self.target_cache)
        return out.logits, out.routed_ids

    def draft_step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed tokens [n] to the draft at positions start.. -> logits of the last position [V]."""
        return self.draft.forward(tokens, start, self.draft_cache).logits[-1]

    def observe_plain_step(self, seconds: float) -> None:
        self._plain_steps.append(seconds)

    def current_decode_step_seconds(self) -> float:
        """Median of the recent plain decode steps; the start-up calibration until there are 8."""
        if len(self._plain_steps) < 8:
            return self.decode_step_seconds
        return statistics.median(self._plain_steps)

    def _calibrate_decode_step(self, steps: int = 24) -> float:
        """Median wall time of a plain decode step: the unit of `decode_step_equivalents`."""
        prompt = torch.tensor(self.tokenizer.encode("def main():\n    return 0\n").ids)
        times = []
        with torch.inference_mode():
            logits, _ = self.verify_window(prompt, 0)
            token = logits[-1:].argmax(-1)
            for i in range(steps):
                t0 = time.perf_counter()
                logits, _ = self.verify_window(token, prompt.shape[0] + i)
                token = logits.argmax(-1)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[steps // 3:])

    def _model_info(self) -> ModelInfo:
        cfg = self.target.cfg
        drafters = (Drafter.MODEL, Drafter.NGRAM) if self.draft else (Drafter.NGRAM,)
        tunable = ("drafter", "draft_length", "draft_temperature") if self.draft else ("drafter", "draft_length")
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
        )


def unique_experts_per_layer(routed: torch.Tensor, num_experts: int) -> tuple[int, ...]:
    """routed ids [L, w, m] -> distinct experts per layer: mark every expert any position picked."""
    L = routed.shape[0]
    touched = torch.zeros(L, num_experts, dtype=torch.bool).scatter_(1, routed.reshape(L, -1), True)  # [L, E]
    return tuple(touched.sum(-1).tolist())


class _Generation:
    """The state of one request; `run` is the decode loop."""

    def __init__(self, engine: Engine, request: GenerationRequest, policy: DraftPolicy, prompt: list[int],
                 should_stop: Callable[[], bool] | None, on_delta: Callable[[StreamDelta], None] | None):
        self.e, self.request, self.policy = engine, request, policy
        self.prompt_len = len(prompt)
        self.tokens = torch.tensor(prompt, dtype=torch.long)  # [n] prompt + committed tokens
        self.budget = min(request.max_new_tokens, engine.max_context - len(prompt))
        self.should_stop = should_stop or (lambda: False)
        self.on_delta = on_delta
        seed = request.sampling.seed
        self.gen = torch.Generator()
        if seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(seed)
        self.draft_valid = 0  # tokens of self.tokens whose keys/values the draft cache holds
        self.steps: list[StepRecord] = []
        self.sent_chars = 0  # completion text already streamed
        self.holdback = max((len(s) for s in request.stop), default=1) - 1

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len:].tolist()

    def run(self) -> GenerationResult:
        t0 = time.perf_counter()
        if self.prompt_len > 1:
            # Prefill all but the last prompt token: every output token then comes from a step
            # whose window starts at the last committed token, the first step included.
            self.e.verify_window(self.tokens[:-1], 0)
        ttft, finish = 0.0, None
        while finish is None:
            if self.should_stop():
                finish = FinishReason.CANCELLED
                break
            committed, record = self._step()
            finish, record = self._commit(committed, record)
            self.steps.append(record)
            ttft = ttft or time.perf_counter() - t0
        return self._result(finish, time.perf_counter() - t0, ttft)

    # ------------------------------------------------------------------ one step
    def _step(self) -> tuple[torch.Tensor, StepRecord]:
        e, policy = self.e, self.policy
        n_tokens = self.tokens.shape[0]
        remaining = self.budget - (n_tokens - self.prompt_len)
        k = min(policy.draft_length, remaining - 1)  # never draft past the budget or the cache
        t0 = time.perf_counter()
        drafts, q = self._draft(k) if k > 0 else (self.tokens[:0], None)
        t1 = time.perf_counter()
        window = torch.cat([self.tokens[-1:], drafts])  # [w] last committed token + drafts
        logits, routed = e.verify_window(window, n_tokens - 1)
        if self.request.sampling.greedy:  # p is a point mass: acceptance is an exact prefix match
            n_ok, flags, bonus = accept_greedy(drafts, logits.argmax(-1))
        else:
            p = target_probs(logits, self.request.sampling)  # [w, V]
            n_ok, flags, bonus = accept(drafts, q if q is not None else p[:0], p, self.gen)
        t2 = time.perf_counter()
        if policy.drafter is Drafter.MODEL and k > 0:
            # The draft cache holds the old tokens plus drafts 1..k-1; keep those that were accepted.
            self.draft_valid = n_tokens + min(n_ok, k - 1)
        committed = torch.cat([drafts[:n_ok], bonus])
        record = self._record(drafts.shape[0], n_ok, flags, window, routed, t1 - t0, t2 - t1)
        return committed, record

    def _draft(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose up to k tokens -> (drafts [k'], q [k', V] the distribution each was drawn from)."""
        e, policy = self.e, self.policy
        if policy.drafter is Drafter.NGRAM:
            drafts = ngram.propose(self.tokens, k, e.config.ngram_min, e.config.ngram_max)
            return drafts, point_mass(drafts, e.info.vocab_size)
        # Catch the draft up on committed tokens it has not seen, then draft autoregressively.
        pending, start = self.tokens[self.draft_valid:], self.draft_valid
        drafts, qs = [], []
        for _ in range(k):
            logits = e.draft_step(pending, start).unsqueeze(0)  # [1, V]
            q = draft_probs(logits, policy.draft_temperature)
            # A greedy draft's q is a point mass: its argmax is the sample, no random draw needed.
            token = logits.argmax(-1) if policy.draft_temperature == 0 else sample(q, self.gen)
            drafts.append(token)
            qs.append(q)
            start += pending.shape[0]
            pending = token
        return torch.cat(drafts), torch.cat(qs)

    def _record(self, drafted: int, accepted: int, flags: torch.Tensor, window: torch.Tensor, routed: torch.Tensor,
                draft_s: float, verify_s: float) -> StepRecord:
        if window.shape[0] == 1:
            self.e.observe_plain_step(verify_s)
        cfg, policy, capture = self.e.target.cfg, self.policy, self.e.config.capture_topk or self.e.recorder is not None
        ep = {}  # the optional expert-parallel fields, estimated only with an EP size
        if self.e.ep is not None:
            ep = expert_parallel.step_fields(expert_parallel.pass_view(self.e.ep, routed, self.e.ep_token_bytes))
        L, E, m = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        unique = unique_experts_per_layer(routed, E) if self.e.config.capture_routing else (0,) * L
        return StepRecord(
            drafter=policy.drafter,
            draft_length=policy.draft_length,
            draft_temperature=policy.draft_temperature,
            policy_id=policy.policy_id,
            drafted=drafted,
            accepted=accepted,
            committed=accepted + 1,
            accepted_per_position=tuple(flags[:drafted].tolist()),
            window=window.shape[0],
            unique_experts=unique,
            shared_experts=1,
            unique_experts_bound=min(E, window.shape[0] * m),
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            decode_step_equivalents=verify_s / self.e.current_decode_step_seconds(),
            topk_ids=tuple(tuple(tuple(pos) for pos in layer) for layer in routed.tolist()) if capture else None,
            window_ids=tuple(window.tolist()) if capture else None,
            **ep,
        )

    # ------------------------------------------------------------ commit and stop
    def _commit(self, new: torch.Tensor, record: StepRecord) -> tuple[FinishReason | None, StepRecord]:
        """Append committed tokens, apply EOS / stop strings / budget, stream what is final.

        EOS ends the output (it is kept in token_ids, not in the text); tokens a step committed
        after it are dropped, so that step's `committed` counts only what reached the output.
        """
        new_ids = new.tolist()
        finish = None
        if self.e.eos_id in new_ids:
            new_ids = new_ids[:new_ids.index(self.e.eos_id) + 1]
            finish = FinishReason.STOP
            record = dataclasses.replace(record, committed=len(new_ids))
        self.tokens = torch.cat([self.tokens, torch.tensor(new_ids, dtype=torch.long)])
        text = self.e.decode(self.completion)
        cut = self._stop_index(text)
        if cut is not None:
            text, finish = text[:cut], FinishReason.STOP
        elif finish is None and self.tokens.shape[0] - self.prompt_len >= self.budget:
            finish = FinishReason.LENGTH
        if self.on_delta is not None:
            self._stream(text, new_ids, record, final=finish is not None)
        return finish, record

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        return min(hits) if hits else None

    def _stream(self, text: str, new_ids: list[int], record: StepRecord, final: bool) -> None:
        # Hold back a possible partial stop string and an incomplete UTF-8 sequence until final.
        end = len(text) if final else len(text) - self.holdback
        while not final and end > self.sent_chars and text[end - 1] == "\ufffd":
            end -= 1
        delta = text[self.sent_chars:max(end, self.sent_chars)]
        self.sent_chars += len(delta)
        self.on_delta(StreamDelta(text=delta, token_ids=tuple(new_ids), step=record))

    def _result(self, finish: FinishReason, seconds: float, ttft: float) -> GenerationResult:
        completion = self.completion
        text = self.e.decode(completion)
        cut = self._stop_index(text)
        if cut is not None:
            text = text[:cut]
        return GenerationResult(
            text=text,
            token_ids=tuple(completion),
            finish_reason=finish,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(completion),
            spec=SpecStats.from_steps(self.steps, self.policy, self.e.target.cfg.num_hidden_layers),
            steps=tuple(self.steps),
            seconds=seconds,
            time_to_first_token=ttft,
        )
