"""SGLangBackend: service.backend.Backend on an in-process sglang.Engine.

Contract:
- One request at a time (a lock): the recorder then holds exactly that request's passes, and
  Engine's blocking API allows no concurrent callers anyway (engine_slot.py). The adapter already
  splits multi-request passes, so batching needs only an engine thread, not new accounting.
- A request whose policy needs other start-up arguments than the running engine swaps the engine
  first (stop, start, warm-up) under the lock; the measured wall time of that swap is published as
  `info.policy_switch_seconds` and logged. policy_id / draft_temperature changes swap nothing.
- Plain-decoding requests keep `info.decode_step_seconds` calibrated (median per-token decode time).
- Stream deltas carry tokens as SGLang emits them; their `step` is None because steps are only
  known once the recorder is read after the request.
- With an EP size (ep.py) steps carry the ep_* fields; with `record_steps` every request whose
  steps all came from the recorder is appended to that file (service/recording.py, the embedded
  engine's format, for `moespec whatif`). A request rebuilt from meta_info counts alone (recorder
  off, or passes not found) has no routed ids to record and is left out, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from service.limits import PromptLimits, tokenizer_prompt_bytes
from service.recording import StepRecorder
from service.sglang_backend.adapter import FinishedRequest, adapt
from service.sglang_backend.attribution import RequestTokens
from service.sglang_backend.engine_slot import EngineSlot
from service.sglang_backend.ep import EPConfig
from service.sglang_backend.meta_info import finish_reason
from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.policy import SpecConfig, effective_policy, speculative_kwargs
from service.sglang_backend.sampling import sampling_params
from service.types import (
    DraftPolicy,
    GenerationRequest,
    GenerationResult,
    InvalidRequest,
    ModelInfo,
    StreamDelta,
    new_token_budget,
)

log = logging.getLogger(__name__)

WARMUP_TOKENS = 32  # enough decode steps for a stable median, short enough to keep swaps cheap
CALIBRATION_WINDOW = 64  # recent plain-decode requests the decode-step median is taken over


@dataclass(frozen=True)
class BackendConfig:
    target: MoeGeometry
    info: ModelInfo
    spec: SpecConfig
    base_kwargs: dict  # sglang.Engine arguments shared by every policy
    record_dir: Path | None  # None: expert recording off (counts only, no unions)
    keep_records: bool = False  # archive every read dump with its request's tokens and meta_info
    tokenizer_path: Path | None = None  # tokenizer.json for text prompts
    capture_topk: bool = False
    calibrate: bool = True  # measure a plain decode step (and a first swap) at start-up
    cleanup: tuple[Path, ...] = ()  # temp dirs this backend made (recorder dumps, checkpoint view)
    ep: EPConfig | None = None  # fill the steps' ep_* fields (--ep-size)
    record_steps: Path | None = None  # append every request's steps to this file (--record-steps)


class SGLangBackend:
    def __init__(self, config: BackendConfig, sglang: ModuleType, initial_policy: DraftPolicy):
        self.config = config
        self.info: ModelInfo = config.info
        self._lock = threading.Lock()
        self._slot = EngineSlot(sglang, config.base_kwargs, config.record_dir, config.keep_records)
        self._tokenizer = _load_tokenizer(config.tokenizer_path)
        # Checked by the server before any work (service/limits.py).
        self.prompt_limits = PromptLimits(
            self.info.max_context,
            tokenizer_prompt_bytes(self._tokenizer, self.info.max_context) if self._tokenizer else None,
            self.info.vocab_size)
        self._decode_samples: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        self._starts = 0  # engines started so far; every start after the first is a policy switch
        with self._lock:
            if config.calibrate and initial_policy.draft_length:
                # Start plain first: calibrates the decode step and measures one real swap.
                self._ensure(dataclasses.replace(initial_policy, draft_length=0))
            self._ensure(initial_policy)
        # Opened after the calibration, so the header carries the measured plain decode step.
        self._recorder = (StepRecorder(config.record_steps, self.info, config.target.hidden_size)
                          if config.record_steps else None)

    # ------------------------------------------------------------------ Backend
    def generate(
        self,
        request: GenerationRequest,
        policy: DraftPolicy,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> GenerationResult:
        request.validate(self.info.vocab_size, self.info.max_context)
        policy.validate(self.info.max_draft_length)
        if policy.cells:
            raise InvalidRequest("policy.cells", "SGLang fixes speculation at engine start-up: one policy for every "
                                 "step, not a table keyed by the step's context")
        speculative_kwargs(policy, self.config.spec)  # refuses a drafter this server does not offer
        prompt = self._prompt_ids(request)
        with self._lock:
            self._ensure(policy)
            run = self._run(prompt, request, should_stop, on_delta)
            passes = self._slot.take_passes(evidence={"policy": dataclasses.asdict(policy), "prompt_ids": prompt,
                                                      "output_ids": list(run.output_ids), "meta_info": run.meta})
            done = FinishedRequest(RequestTokens(tuple(prompt), run.output_ids), run.meta, run.seconds - run.ttft)
            decode_step = self.info.decode_step_seconds
            if policy.draft_length == 0 and not run.cancelled:
                self._calibrate(done)
        adapted = adapt(passes, [done], effective_policy(policy), self.config.target,
                        decode_step_seconds=decode_step, ep=self.config.ep,
                        capture_topk=self.config.capture_topk or self._recorder is not None)[0]
        if self._recorder is not None:
            if adapted.from_records:
                self._recorder.write(adapted.steps)  # never raises: a full disk loses the recording only
            else:
                log.warning("request not written to %s: its steps were rebuilt from meta_info counts, "
                            "without routed ids", self.config.record_steps)
        return GenerationResult(
            text=run.text,
            token_ids=run.output_ids,
            finish_reason=finish_reason(run.meta, run.cancelled),
            prompt_tokens=len(prompt),
            completion_tokens=len(run.output_ids),
            spec=adapted.spec,
            steps=adapted.steps,
            seconds=run.seconds,
            time_to_first_token=run.ttft,
        )

    def prepare(self, policy: DraftPolicy) -> None:
        """Start the engine a policy needs now rather than on its first request."""
        with self._lock:
            self._ensure(policy)

    def close(self) -> None:
        with self._lock:
            self._slot.stop()
        if self._recorder is not None:
            self._recorder.close()
        for path in self.config.cleanup:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ internals
    def _ensure(self, policy: DraftPolicy) -> None:
        spec_kwargs = speculative_kwargs(policy, self.config.spec)
        if self._slot.running(spec_kwargs):
            return
        t0 = time.perf_counter()
        self._slot.start(spec_kwargs)
        warm = self._warm_up(plain=not spec_kwargs)
        seconds = time.perf_counter() - t0
        if self._starts:
            # The first start is not a switch; every later one is what a policy change costs.
            self.info = dataclasses.replace(self.info, policy_switch_seconds=seconds,
                                            policy_switches=self.info.policy_switches + 1)
            log.warning("policy change swapped the sglang engine in %.1f s (%s)", seconds, spec_kwargs or "plain")
        self._starts += 1
        if warm is not None:
            self._calibrate(warm)

    def _warm_up(self, plain: bool) -> FinishedRequest | None:
        """One short greedy request: cold paths (CUDA graphs, allocator) run before real traffic."""
        prompt = list(range(1, 9))
        request = GenerationRequest(prompt_token_ids=tuple(prompt), max_new_tokens=WARMUP_TOKENS)
        run = self._run(prompt, request, None, None, greedy=True)
        self._slot.take_passes(evidence={"warm_up": True})  # its passes belong to no request
        if not plain:
            return None
        return FinishedRequest(RequestTokens(tuple(prompt), run.output_ids), run.meta, run.seconds - run.ttft)

    def _calibrate(self, done: FinishedRequest) -> None:
        steps = len(done.tokens.output_ids) - 1
        if steps < 1 or done.decode_seconds <= 0:
            return
        self._decode_samples.append(done.decode_seconds / steps)
        self.info = dataclasses.replace(self.info, decode_step_seconds=statistics.median(self._decode_samples))

    def _run(self, prompt: list[int], request: GenerationRequest, should_stop, on_delta, greedy: bool = False) -> _Run:
        rid = uuid.uuid4().hex
        params = sampling_params(request, greedy=greedy)
        # As the embedded engine: the context bounds the budget instead of failing the request.
        params["max_new_tokens"] = new_token_budget(params["max_new_tokens"], len(prompt), self.info.max_context)
        t0 = time.perf_counter()
        ttft, output, text, meta, cancelled = 0.0, (), "", {}, False
        for chunk in self._slot.stream(prompt, params, rid):
            ids = tuple(chunk.get("output_ids") or ())
            new_text = chunk.get("text") or text
            if ids and not ttft:
                ttft = time.perf_counter() - t0
            if on_delta is not None and len(ids) > len(output):
                on_delta(StreamDelta(text=new_text[len(text):], token_ids=ids[len(output):], step=None))
            output, text, meta = ids, new_text, chunk.get("meta_info") or meta
            if should_stop is not None and not cancelled and should_stop():
                cancelled = True
                self._slot.abort(rid)
        return _Run(output, text, meta, time.perf_counter() - t0, ttft, cancelled)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        elif self._tokenizer is None:
            raise InvalidRequest("prompt", "this server has no tokenizer.json; send prompt_token_ids")
        else:
            ids = self._tokenizer.encode(request.prompt).ids
        if not ids:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
        if len(ids) >= self.info.max_context:
            raise InvalidRequest("prompt", f"{len(ids)} tokens; the context holds {self.info.max_context} "
                                           "including at least one new token")
        return ids


@dataclass(frozen=True)
class _Run:
    output_ids: tuple[int, ...]
    text: str
    meta: dict
    seconds: float
    ttft: float
    cancelled: bool


def _load_tokenizer(path: Path | None):
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer  # a base dependency; only needed for text prompts

    return Tokenizer.from_file(str(path))
