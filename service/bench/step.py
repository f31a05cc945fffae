"""Where a plain decode step's time goes: the verify pass against the whole step, through `moespec serve`
at its defaults (one client, unary calls) and in-process.

A plain step is one verify pass (the target's forward over one token and the verdict: its argmax) plus
everything the engine does around it: the scheduler's iteration, the step and pass records, the
commit. Both figures come from the engine's own clocks, so transport is left out:
- the step: a request's decode time over its decode steps, (seconds - time to first token) / (tokens
  - 1), from the reply (served) or the result (in-process);
- the verify pass: the steps' summed verify seconds over their count (`SpecStats`).
- the forward alone: the in-process engine's target forward passes (`forward_ragged`: the embedding,
  every layer, the final norm, the output layer and the argmax), timed around the call over the
  round's decode steps; the served engine runs the same model and kernels, so its rows take the
  in-process forward of the same round.
Work outside the verify pass is then 1 - verify / step, work outside the forward 1 - forward / step.
The two paths run interleaved, the order swapped every round, on the same greedy requests; with several
`--steps-per-call` values, both paths at each value (a server and an engine for each), all
interleaved. Inside a call of several plain steps the kernel times each step, and that is both its verify
pass and its forward (no verdict runs between them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from service.bench.engine import load_prompts
from service.bench.server import ServeProcess
from service.engine_defaults import STEPS_PER_CALL
from service.errors import UsageError
from service.types import DraftPolicy, GenerationRequest, SamplingParams


@dataclass(frozen=True)
class StepSplit:
    path: str
    round: int
    step_us: float  # median over the requests of decode seconds per decode step
    verify_us: float  # median over the requests of verify seconds per verify step
    forward_us: float = 0.0  # the round's in-process forward pass, mean over its decode steps
    steps_per_call: int = STEPS_PER_CALL  # the engine's --steps-per-call on both paths

    @property
    def outside_share(self) -> float:
        return 1 - self.verify_us / self.step_us

    @property
    def outside_forward_share(self) -> float:
        return 1 - self.forward_us / self.step_us


class ForwardClock:
    """Times a model's decode forwards (prefill runs `fill_cache`): each `forward_ragged` call, and each
    step of a `decode_steps` call (several plain steps in one kernel call), as the kernel times it."""

    def __init__(self, model):
        self.seconds, self.calls = 0.0, 0
        inner, inner_steps = model.forward_ragged, model.decode_steps

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        def timed_steps(*args, **kwargs):
            picks, routed, seconds = inner_steps(*args, **kwargs)
            self.seconds += sum(seconds)
            self.calls += len(seconds)
            return picks, routed, seconds

        # This instance only: what the engine's model runner calls.
        model.forward_ragged, model.decode_steps = timed, timed_steps

    def take_us(self) -> float:
        """The mean forward since the last take, in microseconds."""
        mean = 1e6 * self.seconds / max(self.calls, 1)
        self.seconds, self.calls = 0.0, 0
        return mean


def split(path: str, round_: int, results: list) -> StepSplit:
    """results: replies or GenerationResults (both carry seconds, time_to_first_token, token ids, spec)."""
    steps = [(r.seconds - r.time_to_first_token) / (len(r.token_ids) - 1) for r in results]
    verify = [r.spec.verify_seconds / r.spec.verify_steps for r in results]
    return StepSplit(path, round_, 1e6 * statistics.median(steps), 1e6 * statistics.median(verify))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8, help="how many shipped held-out prompts per round")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[STEPS_PER_CALL],
                        help="the engine's setting on both paths; several values run interleaved in every round "
                             "(default: the server's, %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write step.json here")


def run(args: argparse.Namespace) -> int:
    settings = list(dict.fromkeys(args.steps_per_call))
    if min(args.prompts, args.rounds, *settings) < 1 or args.max_new_tokens < 2:
        raise UsageError("--prompts, --rounds and --steps-per-call must be >= 1, --max-new-tokens >= 2 (a "
                         "decode step follows the first token)")
    from service.engine import Engine, EngineConfig
    from service.server.client import MoespecClient

    requests = [GenerationRequest(prompt=p[-400:], max_new_tokens=args.max_new_tokens,
                                  sampling=SamplingParams(temperature=0)) for p in load_prompts(args.prompts)]
    plain, rows = DraftPolicy(), []
    # The server's defaults, in this process and in a `moespec serve` child, for each setting.
    engines = {n: Engine(EngineConfig(steps_per_call=n)) for n in settings}
    clocks = {n: ForwardClock(engine.target) for n, engine in engines.items()}
    try:
        with contextlib.ExitStack() as stack:
            runs = {}
            for n, engine in engines.items():
                address = stack.enter_context(ServeProcess(["--port", "0", "--steps-per-call", str(n)]))
                client = stack.enter_context(MoespecClient(address))
                client.wait_ready(timeout=120)
                runs[n, "served"] = lambda c=client: [c.generate(r, timeout=600) for r in requests]
                runs[n, "in_process"] = lambda e=engine: [e.generate(r, plain) for r in requests]
            for run_ in runs.values():  # warm-up: first calls pay one-off costs
                run_()
            for round_ in range(args.rounds):
                for clock in clocks.values():
                    clock.take_us()
                order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
                splits = [replace(split(path, round_, runs[n, path]()), steps_per_call=n) for n, path in order]
                forward_us = {n: clock.take_us() for n, clock in clocks.items()}
                rows += [replace(s, forward_us=forward_us[s.steps_per_call]) for s in splits]
    finally:
        for engine in engines.values():
            engine.close()
    print(markdown(rows, args))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step.json").write_text(json.dumps([asdict(r) | {"outside_share": r.outside_share,
                                                                     "outside_forward_share": r.outside_forward_share}
                                                        for r in rows], indent=2) + "\n")
    return 0


def markdown(rows: list[StepSplit], args: argparse.Namespace) -> str:
    def fmt(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"

    settings = " ".join(str(n) for n in dict.fromkeys(args.steps_per_call))
    lines = [f"Plain greedy decoding, one request at a time (`moespec bench step --prompts {args.prompts} "
             f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds} --steps-per-call {settings}`; "
             "median [min, max] over rounds)", "",
             "| path | plain steps per call | decode step us | verify pass us (forward + verdict) | forward us "
             "(in-process) | work outside the verify pass | work outside the forward |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for n, path in dict.fromkeys((r.steps_per_call, r.path) for r in rows):
        mine = [r for r in rows if (r.steps_per_call, r.path) == (n, path)]
        lines.append(f"| {path.replace('_', '-')} | {n} | {fmt([r.step_us for r in mine], 1)} | "
                     f"{fmt([r.verify_us for r in mine], 1)} | {fmt([r.forward_us for r in mine], 1)} | "
                     f"{fmt([r.outside_share for r in mine], 3)} | {fmt([r.outside_forward_share for r in mine], 3)} |")
    return "\n".join(lines) + "\n"
