"""Shared pieces of the engine tests: the shipped model pair, a goodness-of-fit test, deliberately
wrong acceptance rules (negative controls) patched in where the engine looks sampling up, and a
backend that holds a request between two steps so gRPC tests act while it is in flight."""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable

import torch
from scipy.stats import chi2, chisquare, ncx2

from service.engine import Engine, EngineConfig
from service.engine.model.ragged import KVCache, RaggedBatch
from service.engine.model.weights import MODELS_DIR
from service.engine.spec import sampling
from tests.conftest import RecordingBackend

PROMPTS_FILE = MODELS_DIR.parent / "prompts" / "heldout.jsonl"

# The module whose globals a verify pass's acceptance calls the sampling functions through (accept,
# accept_greedy_ids, target_probs). Negative controls patch them there, only through
# `patch_engine_sampling`: if the acceptance moves to another module, change this one name.
SAMPLING_LOOKUP = "service.engine.spec.acceptance"


def heldout_prompts(count: int) -> list[str]:
    lines = PROMPTS_FILE.read_text().splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


def make_engine(**overrides) -> Engine:
    # One intra-op thread: the per-step ops are small, and other test processes may share the cores.
    return Engine(EngineConfig(**{"threads": 1, "math": "fp32", **overrides}))


def draft_next_token_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The engine's draft logits [1, V] for the token after ids, from fresh caches (a draft head's
    are -inf outside its vocabulary: probability 0 there)."""
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        if not engine.runtime.draft_is_head:
            return engine.draft.forward(tokens, 0, KVCache(engine.draft.cfg, len(ids))).logits[-1:]
        features = engine.target.forward(tokens, 0, KVCache(engine.target.cfg, len(ids))).features
        entry_features = torch.cat([features.new_zeros(1, features.shape[1]), features[:-1]])  # entry p reads p - 1
        logits, _ = engine.draft.forward_ragged(engine.target.embed_tokens(tokens), entry_features,
                                                RaggedBatch.build([0], [0], [len(ids)]),
                                                KVCache(engine.draft.cfg, len(ids)), torch.tensor([len(ids) - 1]))
    full = logits.new_full((1, engine.target.cfg.vocab_size), float("-inf"))
    full[0, engine.draft.vocab] = logits[0]
    return full


def prefilled_sequence(engine: Engine, ids: list[int], policy, sampling_params):
    """A sequence of `ids` in slot 0 of an idle engine (its scheduler runs nothing: the slot is the
    caller's), its prompt prefilled as the scheduler's thread would."""
    from service.engine.model_runner import PrefillChunk
    from service.engine.sequence import Sequence
    from service.types import GenerationRequest

    seq = Sequence(GenerationRequest(prompt_token_ids=tuple(ids), sampling=sampling_params), policy, ids, 16, None,
                   None)
    seq.slot = 0
    with torch.inference_mode():
        engine._scheduler.runner.prefill([PrefillChunk(seq, 0, len(ids) - 1, completes=True)])
    return seq


def first_tree_steps(engine: Engine, ids: list[int], policy, sampling_params, requests: int) -> tuple[list, list]:
    """`requests` seeded requests of 4 new tokens (room for a tree of 3 nodes in their first step) under
    a tree policy -> (each one's first two tokens, each one's first step)."""
    import dataclasses

    from service.types import GenerationRequest

    outputs, first_steps = [], []
    for seed in range(requests):
        request = GenerationRequest(prompt_token_ids=tuple(ids), max_new_tokens=4,
                                    sampling=dataclasses.replace(sampling_params, seed=seed))
        result = engine.generate(request, policy)
        outputs.append(result.token_ids[:2])
        first_steps.append(result.steps[0])
    return outputs, first_steps


def patch_engine_sampling(monkeypatch, engine: Engine, **functions: Callable) -> None:
    """Replace sampling functions (by name) where the engine's decode loop looks them up, and send the
    engine's sampled windows down the torch path that looks them up (the kernels decide them in C
    otherwise: tests/engine/kernels/test_sampling_kernel.py checks those against this path)."""
    monkeypatch.setattr(engine.runtime, "sampler", None)
    module = importlib.import_module(SAMPLING_LOOKUP)
    for name, function in functions.items():
        if not hasattr(module, name):  # a renamed function must not leave the real one in place
            raise AttributeError(f"{SAMPLING_LOOKUP} does not look up {name!r}")
        monkeypatch.setattr(module, name, function)


def _pooled_bins(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Chi-square bins for n draws from probs [V]: one per outcome expected 5+ times, the rest
    pooled (folded into the largest bin when even the pool is expected fewer than 5 times).
    -> (bin of each outcome [V], number of bins)."""
    expected = probs.double() * n
    big = expected >= 5
    bins = torch.full(probs.shape, int(big.sum()), dtype=torch.long)
    bins[big] = torch.arange(int(big.sum()))
    if expected[~big].sum() < 5:
        bins[~big] = bins[int(expected.masked_fill(~big, -1).argmax())]
        return bins, int(big.sum())
    return bins, int(big.sum()) + 1


def _binned(values: torch.Tensor, bins: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.float64).index_add_(0, bins, values.double())


def fit_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of samples to probs [V] (outcomes expected < 5 times pooled)."""
    bins, count = _pooled_bins(probs, len(samples))
    observed = _binned(torch.bincount(torch.tensor(samples), minlength=probs.shape[0]), bins, count)
    expected = _binned(probs, bins, count)
    expected = expected * observed.sum() / expected.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def fit_power(probs: torch.Tensor, wrong: torch.Tensor, n: int, alpha: float) -> float:
    """Probability that `fit_pvalue` of n draws from `wrong` against `probs` falls below alpha
    (the chi-square statistic is then noncentral, noncentrality n * sum (w - p)^2 / p over the bins)."""
    bins, count = _pooled_bins(probs, n)
    p, w = _binned(probs, bins, count), _binned(wrong, bins, count)
    noncentrality = float(n * ((w - p) ** 2 / p).sum())
    return float(ncx2.sf(chi2.isf(alpha, count - 1), count - 1, noncentrality))


# ------------------------------------------------------------------ wrong acceptance rules
# Each has `sampling.accept`'s signature and one realistic bug; a statistical test of the
# lossless claim must reject every one of them (asserted beside the test of the real rule).

def accept_told_q_at_temperature(told: float, real: float) -> Callable:
    """The rule is told the draft's q at temperature `told` while the draft sampled at `real`
    (e.g. told=1: q computed without the draft temperature). softmax(l/told) = q^(real/told), renormalised."""
    def accept(draft, q, p, generator):
        wrong_q = q.pow(real / told)
        return sampling.accept(draft, wrong_q / wrong_q.sum(-1, keepdim=True), p, generator)
    return accept


def accept_bonus_from_q(draft, q, p, generator):
    """When every draft is accepted, the extra token is drawn from the draft's last q, not from p[k]."""
    n, ok, nxt = sampling.accept(draft, q, p, generator)
    if 0 < n == draft.shape[0]:
        nxt = sampling.sample(q[-1:], generator)
    return n, ok, nxt


def accept_residual_from_p(draft, q, p, generator):
    """At a rejection the replacement is drawn from p itself instead of norm(max(0, p - q))."""
    n, ok, nxt = sampling.accept(draft, q, p, generator)
    if n < draft.shape[0]:
        nxt = sampling.sample(p[n:n + 1], generator)
    return n, ok, nxt


def accept_residual_from_abs_difference(draft, q, p, generator):
    """At a rejection the replacement is drawn from norm(|p - q|): mass where p = 0 leaks in."""
    n, ok, nxt = sampling.accept(draft, q, p, generator)
    if n < draft.shape[0]:
        residual = (p[n] - q[n]).abs()
        nxt = sampling.sample((residual / residual.sum()).unsqueeze(0), generator)
    return n, ok, nxt


# ------------------------------------------------------------ a request held in flight
class Hold:
    """A request held after `after_steps` steps: `reached` is set while the engine waits there."""

    def __init__(self, after_steps: int):
        self.after_steps = after_steps
        self.reached = threading.Event()
        self._released = threading.Event()
        self.should_stop: Callable[[], bool] = lambda: False  # the server's, once the request runs

    def release(self) -> None:
        self._released.set()

    def wait_released(self, timeout: float) -> None:
        if not self._released.wait(timeout):
            raise TimeoutError("a held request was never released")


class HoldingBackend(RecordingBackend):
    """The real engine; a request whose seed has a `hold` pauses between two steps until released.

    The engine polls `should_stop` once before every step, so a hold in that poll keeps the request
    in flight, by construction, for as long as a test needs: no timing assumption.
    """

    def __init__(self, engine, timeout: float = 60.0):
        super().__init__(engine)
        self._holds: dict[int, Hold] = {}
        self._timeout = timeout

    def hold(self, seed: int, after_steps: int = 1) -> Hold:
        self._holds[seed] = Hold(after_steps)
        return self._holds[seed]

    def generate(self, request, policy, *, should_stop=None, on_delta=None):
        hold = self._holds.get(request.sampling.seed)
        if hold is not None:
            server_stop = should_stop or (lambda: False)
            hold.should_stop = server_stop
            polls = 0

            def held_stop() -> bool:
                nonlocal polls
                polls += 1
                if polls == hold.after_steps + 1:
                    hold.reached.set()
                    hold.wait_released(self._timeout)
                return server_stop()

            should_stop = held_stop
        return super().generate(request, policy, should_stop=should_stop, on_delta=on_delta)


def transformers_target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The oracle for `target_probs`: transformers' own warpers in generate()'s order
    (temperature, top-k, top-p), then softmax. logits [n, V] -> [n, V]."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    dummy_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return LogitsProcessorList(warpers)(dummy_ids, logits.clone()).softmax(-1)
