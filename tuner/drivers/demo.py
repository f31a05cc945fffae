"""The demo session behind `moespec demo` (its command line: service/cli/demo.py): server + load +
tuner on the embedded model, then a report folder.

What it runs, in one process tree:
1. an OTLP receiver (the tuner's) on a free loopback port;
2. `moespec serve --port 0` as a child process (torch backend, a random admin token, OTEL_* aimed at
   the receiver with a 200 ms export delay);
3. the load generator (closed loop, in a thread) and the tuner (in-process, same code as
   `moespec tune`), printing one line per trial;
4. after the winner is applied: best vs plain decoding vs the default policy (model drafter,
   draft_length 3, draft_temperature 1.0), measured side by side in interleaved rounds;
5. the report folder (default ./reports/demo-<timestamp>/): report.md, report.json, PNG plots and
   the command that opens the study in optuna-dashboard. The study stays in <report>/study.db.
The load cycles the first 4 shipped prompts and a window is one pass over them (4 x 48 tokens), so
every policy is measured on the same work. The default budget (20 search trials + 3 re-measurements
+ 3 comparison rounds) takes about two to three minutes on 2 CPU cores.
"""

from __future__ import annotations

import secrets
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy
from tuner.drivers.loadgen import LoadGenerator, LoadSpec, LoadSummary
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.report import write_report
from tuner.drivers.server_proc import start_server, telemetry_env
from tuner.loop.assemble import Assembled, TuneSettings, assemble
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, rationale
from tuner.loop.study import PolicyScore
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.compare import Compared, compare
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.spans import request_sample
from tuner.measurement.window import Objective, WindowSpec

DEFAULT_POLICY = DraftPolicy(Drafter.MODEL, 3, 1.0)


@dataclass(frozen=True)
class DemoSettings:
    """One demo session's knobs, checked (service/cli/demo.py builds them from `moespec demo`'s flags)."""

    trials: int
    remeasure: int
    prompt_count: int
    min_tokens: int  # committed tokens per trial window, resolved (the CLI's default: one pass over the prompts)
    min_steps: int
    max_window_seconds: float
    compare_rounds: int
    concurrency: int
    max_new_tokens: int
    temperature: float
    top_p: float
    objective: Objective
    sampler: SamplerKind
    seed: int
    threads: int | None  # server torch threads; None: torch's default
    prompts: Path  # the prompt file the load came from, for the report


@dataclass
class Session:
    """What one demo session produced, for the report."""

    built: Assembled
    winner: PolicyScore | None
    compared: list[Compared]
    load: LoadSummary
    tune_seconds: float


def run_session(demo: DemoSettings, storage, prompts: list[str], err: TextIO) -> Session:
    """Receiver, server, load and tuner up; tune; compare; everything torn down on the way out."""
    from otel.receiver import OtlpTraceReceiver  # grpc machinery only once the arguments are good

    token = secrets.token_hex(16)
    collector = SpanCollector(request_sample)
    stop_load = threading.Event()
    with ExitStack() as stack:
        receiver = OtlpTraceReceiver("127.0.0.1", 0, on_spans=collector.on_spans)
        receiver.start()
        stack.callback(receiver.stop, 0.5)
        print(f"demo: starting moespec serve (spans -> {receiver.endpoint}) ...", file=err, flush=True)
        server_args = ("--threads", str(demo.threads)) if demo.threads else ()
        server = stack.enter_context(start_server(telemetry_env(receiver.endpoint), token, server_args))
        print(f"demo: server on {server.address}; load: {demo.concurrency} callers x {demo.max_new_tokens} "
              f"tokens, temperature {demo.temperature}", file=err, flush=True)
        client = stack.enter_context(MoespecClient(server.address, admin_token=token))
        client.wait_ready(timeout=60)
        load, load_thread = _start_load(stack, client, prompts, demo, stop_load)

        tune = _tune_settings(demo, server.address)
        admin = PolicyAdmin(client, server.address, retry_seconds=10)
        print(f"demo: sampler {rationale(tune.sampler)}", file=err, flush=True)
        built = assemble(tune, storage, admin, collector, ProgressPrinter(err, demo.objective.value))
        tune_started = time.monotonic()
        winner = built.tuner.run()
        tune_seconds = time.monotonic() - tune_started

        compared = []
        if demo.compare_rounds and winner is not None:
            compared = _compare_with_baselines(admin, collector, built, tune.window, winner, demo.compare_rounds, err)
            admin.apply(winner.policy)  # leave the server on the winner
        stop_load.set()
        load_thread.join(30)
        return Session(built, winner, compared, load.summary(), tune_seconds)


def _start_load(stack: ExitStack, client: MoespecClient, prompts: list[str], demo: DemoSettings,
                stop_load: threading.Event) -> tuple[LoadGenerator, threading.Thread]:
    """The closed-loop load in its own thread; the stack stops and joins it on the way out."""
    load = LoadGenerator(client, prompts, LoadSpec(concurrency=demo.concurrency, max_new_tokens=demo.max_new_tokens,
                                                   temperature=demo.temperature, top_p=demo.top_p, seed=demo.seed))
    load_thread = threading.Thread(target=load.run, args=(stop_load,), daemon=True, name="loadgen")
    load_thread.start()
    stack.callback(load_thread.join, 30)
    stack.callback(stop_load.set)
    return load, load_thread


def _tune_settings(demo: DemoSettings, server_address: str) -> TuneSettings:
    return TuneSettings(
        study_name="demo",
        trials=demo.trials,
        tuner_id=f"demo:{server_address}",
        objective=demo.objective,
        sampler=demo.sampler,
        seed=demo.seed,
        window=WindowSpec(demo.min_tokens, demo.min_steps, demo.max_window_seconds),
        remeasure_top=demo.remeasure,
        initial_design=InitialDesign.CORNERS,
    )


def _compare_with_baselines(admin: PolicyAdmin, collector: SpanCollector, built: Assembled, window: WindowSpec,
                            winner: PolicyScore, rounds: int, err: TextIO) -> list[Compared]:
    """Best vs plain decoding vs the default policy, side by side in interleaved rounds."""
    print(f"demo: best vs plain vs default, {rounds} interleaved rounds ...", file=err, flush=True)
    measurer = Measurer(admin, collector, MeasureConfig(
        window=window, prune=PruneRule(factor=0), objective=Objective.MEASURED, cost=built.cost))
    policies = {"best": winner.policy, "plain": DraftPolicy(draft_length=0), "default": DEFAULT_POLICY}
    return compare(measurer, policies, rounds, "demo/compare",
                   lambda n, r, v: print(f"  {n} round {r}: {v * 1e3:.3f} ms/tok", file=err, flush=True))


def write_session_report(out: Path, session: Session, demo: DemoSettings, storage_url: str, dashboard: str,
                         elapsed_seconds: float) -> Path:
    """The report folder (tuner/drivers/report.py), with the session's load and settings beside the study."""
    built = session.built
    extra = {
        "elapsed_seconds": round(elapsed_seconds, 1),
        "tuning_seconds": round(session.tune_seconds, 1),
        "load": {**session.load.as_dict(), "concurrency": demo.concurrency, "max_new_tokens": demo.max_new_tokens,
                 "temperature": demo.temperature, "top_p": demo.top_p, "prompts": str(demo.prompts)},
        "settings": {"trials": demo.trials, "remeasure": demo.remeasure, "min_tokens": demo.min_tokens,
                     "prompt_count": demo.prompt_count,
                     "min_steps": demo.min_steps, "objective": demo.objective.value, "sampler": demo.sampler.value,
                     "seed": demo.seed},
    }
    return write_report(out, study=built.study, space=built.space, info=built.info, winner=session.winner,
                        compared=session.compared, storage_url=storage_url, dashboard=dashboard, extra=extra)
