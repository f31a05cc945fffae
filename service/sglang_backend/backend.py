"""SGLangBackend: service.backend.Backend on an in-process sglang.Engine.

Contract:
- Requests run concurrently: each is submitted to SGLang's async API on the engine's own loop
  (engine_thread.py) and SGLang's scheduler batches whatever is in flight. No lock on the request
  path; the server runs up to `max_batch` callers at once.
- A request whose policy needs other start-up arguments than the running engine drains the requests
  in flight, then swaps the engine (stop, start, warm-up); requests arriving meanwhile wait and run
  on the new engine (swap_gate.py). The measured wall time of each swap is published as
  `info.policy_switch_seconds`. policy_id / draft_temperature changes swap nothing. A change between
  prepared draft lengths (policy.step_switch) drains the same way but then only pins the running
  adaptive engine's step count through the plugin: `info.length_switch_seconds` / `length_switches`.
- Routing statistics come from moespec's plugin inside SGLang's scheduler (service/sglang_plugin/):
  one record per target pass, keyed by request id, pushed over a private socket (stats_channel.py)
  and joined here with the request's tokens (acceptance) and SGLang's own counts (meta_info).
- Plain-decoding requests keep `info.decode_step_seconds` calibrated (median per-token decode time).
- Stream deltas carry tokens as SGLang emits them; their `step` is None (steps are joined at the end).
- With an EP size (ep.py) steps carry the ep_* fields; with `record_steps` every request is appended
  to that file (service/recording.py, the embedded engine's format, for `moespec whatif`).
- With `recorder_dir`, SGLang's own per_token recorder runs beside the plugin as a cross-check: its
  dumps are written there whenever an engine stops (nothing is read back on the request path).
"""

from __future__ import annotations

import dataclasses
import logging
import os
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
from service.security.private_files import make_private
from service.sglang_backend.attribution import RequestTokens
from service.sglang_backend.engine_thread import EngineThread
from service.sglang_backend.ep import EPConfig
from service.sglang_backend.meta_info import SpecMeta, finish_reason
from service.sglang_backend.model_config import MoeGeometry
from service.sglang_backend.policy import (
    SpecConfig,
    effective_policy,
    engine_key,
    engine_tree_temperature,
    needs_eagle_target,
    speculative_kwargs,
    start_arguments,
    step_switch,
)
from service.sglang_backend.sampling import sampling_params
from service.sglang_backend.stats_channel import StatsChannel
from service.sglang_backend.steps import expected_steps, spec_stats, steps_from_meta, steps_from_windows
from service.sglang_backend.swap_gate import SwapGate
from service.sglang_backend.tap_windows import windows_from_tap
from service.sglang_plugin.wire import EAGLE_TARGET_ENV, STEP_PIN_ENV, TAP_ENV, TREE_TAU_ENV
from service.types import (
    Drafter,
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
MAX_BATCH = 64  # concurrent requests handed to SGLang (its scheduler batches them; more wait in the server)
HELLO_SECONDS = 30.0  # how long after an engine is up its scheduler's plugin may take to say hello
RECORDS_SECONDS = 5.0  # how long a finished request waits for its last pass records
# SGLang reads the per_token recorder's dump directory from this variable in its scheduler process.
RECORDER_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


@dataclass(frozen=True)
class BackendConfig:
    target: MoeGeometry
    info: ModelInfo
    spec: SpecConfig
    base_kwargs: dict  # sglang.Engine arguments shared by every policy
    stats: bool = True  # routing statistics from the plugin; False: counts from meta_info only
    recorder_dir: Path | None = None  # also run SGLang's per_token recorder, dumping here (a cross-check)
    tokenizer_path: Path | None = None  # tokenizer.json for text prompts
    capture_topk: bool = False
    calibrate: bool = True  # measure a plain decode step (and a first swap) at start-up
    cleanup: tuple[Path, ...] = ()  # temp dirs this backend made (recorder dumps, checkpoint view)
    ep: EPConfig | None = None  # fill the steps' ep_* fields (--ep-size)
    record_steps: Path | None = None  # append every request's steps to this file (--record-steps)


class SGLangBackend:
    max_batch = MAX_BATCH

    def __init__(self, config: BackendConfig, sglang: ModuleType, initial_policy: DraftPolicy):
        self.config = config
        self.info: ModelInfo = config.info
        self._sglang = sglang
        self._info_lock = threading.Lock()
        self._engine: EngineThread | None = None
        self._engine_spec: dict = {}  # the running engine's speculative arguments, its step count as pinned
        self._channel = StatsChannel() if config.stats else None
        self._gate = SwapGate(lambda p: engine_key(p, config.spec), self._swap)
        self._tokenizer = _load_tokenizer(config.tokenizer_path)
        # Checked by the server before any work (service/limits.py).
        self.prompt_limits = PromptLimits(
            self.info.max_context,
            tokenizer_prompt_bytes(self._tokenizer, self.info.max_context) if self._tokenizer else None,
            self.info.vocab_size)
        self._decode_samples: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        self._starts = 0  # engines started so far; every start after the first is a policy switch
        if config.calibrate and initial_policy.draft_length:
            # Start plain first: calibrates the decode step and measures one real swap.
            self.prepare(dataclasses.replace(initial_policy, draft_length=0))
        self.prepare(initial_policy)
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
        policy = self._gate.enter(policy)
        try:
            run = self._run(prompt, request, policy, should_stop, on_delta)
            decode_step = self.info.decode_step_seconds
            if policy.draft_length == 0 and not run.cancelled:
                self._calibrate(run)
        finally:
            self._gate.leave()
        steps = self._steps(run, effective_policy(policy), decode_step)
        if self._recorder is not None and steps and steps[0].topk_ids is not None:
            self._recorder.write(steps)  # never raises: a full disk loses the recording only
        return GenerationResult(
            text=run.text,
            token_ids=run.output_ids,
            finish_reason=finish_reason(run.meta, run.cancelled),
            prompt_tokens=len(prompt),
            completion_tokens=len(run.output_ids),
            spec=spec_stats(steps, effective_policy(policy), self.config.target),
            steps=tuple(steps),
            seconds=run.seconds,
            time_to_first_token=run.ttft,
        )

    def prepare(self, policy: DraftPolicy) -> None:
        """Start the engine a policy needs now rather than on its first request."""
        self._gate.enter(policy)
        self._gate.leave()

    def close(self) -> None:
        self._stop_engine()
        if self._channel is not None:
            self._channel.close()
        if self._recorder is not None:
            self._recorder.close()
        for path in self.config.cleanup:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ engine swaps
    def _swap(self, policy: DraftPolicy) -> None:
        """Called by the gate with no request in flight: pin the running engine's step count where it
        prepared the policy's length, else stop the engine, start the policy's and warm it up."""
        spec_kwargs = speculative_kwargs(policy, self.config.spec)
        steps = step_switch(self._engine_spec, spec_kwargs) if self._engine is not None else None
        if steps is not None:
            self._pin(steps, spec_kwargs)
            return
        t0 = time.perf_counter()
        self._stop_engine()
        start_kwargs = start_arguments(spec_kwargs, self.config.spec)
        self._engine = self._start_engine(start_kwargs)
        self._engine_spec = start_kwargs
        if spec_kwargs.get("speculative_adaptive"):  # from its start on, moespec sets the count, not SGLang's rule
            self._engine.pin_draft_steps(spec_kwargs["speculative_num_steps"])
            self._engine_spec = spec_kwargs
        warm = self._run(list(range(1, 9)), GenerationRequest(prompt_token_ids=tuple(range(1, 9)),
                                                               max_new_tokens=WARMUP_TOKENS), None, None, None,
                         greedy=True)
        seconds = time.perf_counter() - t0
        with self._info_lock:
            if self._starts:
                # The first start is not a switch; every later one is what a policy change costs.
                self.info = dataclasses.replace(self.info, policy_switch_seconds=seconds,
                                                policy_switches=self.info.policy_switches + 1)
                log.warning("policy change swapped the sglang engine in %.1f s (%s)", seconds,
                            spec_kwargs or "plain")
            self._starts += 1
        if policy.draft_length == 0:
            self._calibrate(warm)

    def _pin(self, steps: int, spec_kwargs: dict) -> None:
        t0 = time.perf_counter()
        self._engine.pin_draft_steps(steps)
        seconds = time.perf_counter() - t0
        self._engine_spec = spec_kwargs
        with self._info_lock:
            self.info = dataclasses.replace(self.info, length_switch_seconds=seconds,
                                            length_switches=self.info.length_switches + 1)
        log.info("policy change pinned %d draft steps in %.3f s (no engine swap)", steps, seconds)

    def _start_engine(self, spec_kwargs: dict) -> EngineThread:
        kwargs = {**self.config.base_kwargs, **spec_kwargs}
        # The scheduler process SGLang spawns inherits this environment: the plugin reads its switch and
        # SGLang its recorder directory there. Other SGLang servers never see them.
        hellos = 0
        if self._channel is not None:
            os.environ[TAP_ENV] = self._channel.config(self._capture_topk).to_env()
            hellos = self._channel.hellos
        else:
            os.environ.pop(TAP_ENV, None)
        if needs_eagle_target(spec_kwargs):  # the plugin's embed_head hook: EAGLE drafts on a Qwen2-MoE target
            os.environ[EAGLE_TARGET_ENV] = "1"
        else:
            os.environ.pop(EAGLE_TARGET_ENV, None)
        if spec_kwargs.get("speculative_adaptive"):  # the plugin's step pin: moespec, not SGLang's rule, sets k
            os.environ[STEP_PIN_ENV] = "1"
        else:
            os.environ.pop(STEP_PIN_ENV, None)
        tau = engine_tree_temperature(spec_kwargs, self.config.spec)
        if tau is not None:  # the plugin's tree ranking: a tree's candidates ranked at that temperature
            os.environ[TREE_TAU_ENV] = repr(tau)
        else:
            os.environ.pop(TREE_TAU_ENV, None)
        if self.config.recorder_dir is not None:
            os.environ[RECORDER_DIR_ENV] = str(self.config.recorder_dir)
            kwargs["expert_distribution_recorder_mode"] = "per_token"
        engine = EngineThread(self._sglang, kwargs, recorder=self.config.recorder_dir is not None)
        if self._channel is not None and self._channel.wait_hello(hellos, HELLO_SECONDS) is None:
            engine.shutdown()
            raise RuntimeError("the moespec plugin did not report from SGLang's scheduler: is moespec installed in "
                               "SGLang's environment (entry point sglang.srt.plugins: moespec) and SGLANG_PLUGINS "
                               "unset or listing it?")
        return engine

    def _stop_engine(self) -> None:
        engine, self._engine, self._engine_spec = self._engine, None, {}
        if engine is None:
            return
        if self.config.recorder_dir is not None:
            engine.dump_recorder()  # the cross-check's evidence for everything this engine ran
            for path in self.config.recorder_dir.glob("expert_distribution_recorder_*.pt"):
                make_private(path)  # written under SGLang's umask; they hold the requests' token ids
        engine.shutdown()

    @property
    def _capture_topk(self) -> bool:
        return self.config.capture_topk or self._recorder_wanted

    @property
    def _recorder_wanted(self) -> bool:
        return self.config.record_steps is not None or self.config.ep is not None

    # ------------------------------------------------------------------ one request
    def _run(self, prompt: list[int], request: GenerationRequest, policy: DraftPolicy | None, should_stop,
             on_delta, greedy: bool = False) -> _Run:
        """policy None: a warm-up, whose passes nobody collects."""
        engine = self._engine
        rid = uuid.uuid4().hex
        params = sampling_params(request, greedy=greedy)
        # As the embedded engine: the context bounds the budget instead of failing the request.
        params["max_new_tokens"] = new_token_budget(params["max_new_tokens"], len(prompt), self.info.max_context)
        collecting = self._channel is not None and policy is not None
        if collecting:
            self._channel.register(rid)
        t0 = time.perf_counter()
        ttft, output, text, meta, cancelled = 0.0, (), "", {}, False
        try:
            for chunk in engine.stream(prompt, params, rid):
                if chunk is not None:
                    ids = tuple(chunk.get("output_ids") or ())
                    new_text = chunk.get("text") or text
                    if ids and not ttft:
                        ttft = time.perf_counter() - t0
                    if on_delta is not None and len(ids) > len(output):
                        on_delta(StreamDelta(text=new_text[len(text):], token_ids=ids[len(output):], step=None))
                    output, text, meta = ids, new_text, chunk.get("meta_info") or meta
                if should_stop is not None and not cancelled and should_stop():
                    cancelled = True
                    engine.abort(rid)
            seconds = time.perf_counter() - t0
            records = []
            if collecting:
                spec = SpecMeta.from_meta_info(meta) if policy.draft_length else None
                records = self._channel.collect(rid, expected_steps(spec, len(output)), RECORDS_SECONDS)
        finally:
            if collecting:
                self._channel.discard(rid)
        return _Run(prompt, output, text, meta, seconds, ttft, cancelled, records)

    def _steps(self, run: _Run, policy: DraftPolicy, decode_step: float) -> list:
        speculative = policy.draft_length > 0
        meta = SpecMeta.from_meta_info(run.meta) if speculative else None
        expected = expected_steps(meta, len(run.output_ids))
        decode_seconds = run.seconds - run.ttft
        tokens = RequestTokens(tuple(run.prompt), run.output_ids)
        windows = windows_from_tap(run.records, tokens, self.config.target, ngram=policy.drafter is Drafter.NGRAM)
        if any(w.drafted > policy.draft_length for w in windows):
            # The engine drafted more than the policy asks (it runs another step count than pinned): the
            # windows are not this policy's, and SGLang's counts are all this request can report.
            log.error("SGLang drafted up to %d tokens per verify pass under a k = %d policy; this request "
                      "reports SGLang's counts only", max(w.drafted for w in windows), policy.draft_length)
        elif self._channel is not None and len(windows) == expected:
            return steps_from_windows(windows, policy, self.config.target, decode_seconds=decode_seconds,
                                      decode_step_seconds=decode_step, capture_topk=self._capture_topk,
                                      ep=self.config.ep)
        elif self._channel is not None and not run.cancelled:
            log.error("the plugin reported %d of %d steps of a request; it reports SGLang's counts only, "
                      "without expert unions", len(windows), expected)
        return steps_from_meta(meta, len(run.output_ids), policy, self.config.target, decode_seconds=decode_seconds,
                               decode_step_seconds=decode_step)

    def _calibrate(self, run: _Run) -> None:
        steps = len(run.output_ids) - 1
        decode = run.seconds - run.ttft
        if steps < 1 or decode <= 0:
            return
        with self._info_lock:
            self._decode_samples.append(decode / steps)
            self.info = dataclasses.replace(self.info, decode_step_seconds=statistics.median(self._decode_samples))

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
    prompt: list[int]
    output_ids: tuple[int, ...]
    text: str
    meta: dict
    seconds: float
    ttft: float
    cancelled: bool
    records: list  # the plugin's RequestPass records, in pass order


def _load_tokenizer(path: Path | None):
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer  # a base dependency; only needed for text prompts

    return Tokenizer.from_file(str(path))
