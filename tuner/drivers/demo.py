"""`moespec demo`: server + load + tuner on the embedded model, then a report folder.

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

import argparse
import secrets
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import optuna

from service.errors import UsageError
from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy
from tuner.drivers.loadgen import DEFAULT_PROMPTS, LoadGenerator, LoadSpec, LoadSummary, first_prompts, load_prompts
from tuner.drivers.progress import ProgressPrinter
from tuner.drivers.report import write_report
from tuner.drivers.server_proc import start_server, telemetry_env
from tuner.loop.assemble import Assembled, TuneSettings, assemble
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, rationale
from tuner.loop.space import policy_key
from tuner.loop.study import PolicyScore, StorageError, dashboard_hint, open_storage
from tuner.loop.tuning import NoTraffic
from tuner.measurement.admin import AdminRejected, PolicyAdmin, ServerUnavailable
from tuner.measurement.collector import SpanCollector
from tuner.measurement.compare import Compared, compare
from tuner.measurement.measure import MeasureConfig, Measurer
from tuner.measurement.spans import request_sample
from tuner.measurement.window import Objective, WindowSpec

DEFAULT_POLICY = DraftPolicy(Drafter.MODEL, 3, 1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Start the server on the embedded model, drive it with the shipped prompts, tune its "
                          "draft policy online, then measure best vs plain vs default side by side and write a "
                          "report folder with plots. Defaults finish in a few minutes on 2 CPU cores.")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default ./reports/demo-<timestamp>)")
    parser.add_argument("--trials", type=int, default=20, help="search trials (default 20)")
    parser.add_argument("--remeasure", type=int, default=3, help="re-measure the best N before the winner")
    parser.add_argument("--prompt-count", type=int, default=4,
                        help="cycle the first N shipped prompts (default 4), so every window serves the same work")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="committed tokens per trial window (default: one pass over the prompts, "
                             "prompt-count x max-new-tokens)")
    parser.add_argument("--min-steps", type=int, default=24, help="verify steps per trial window")
    parser.add_argument("--max-window-seconds", type=float, default=45.0, help="a window longer than this fails")
    parser.add_argument("--compare-rounds", type=int, default=3, help="interleaved rounds of the final comparison")
    parser.add_argument("--concurrency", type=int, default=2, help="load generator callers")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' sampling temperature (0 = greedy, the code-completion default; "
                             "e.g. 0.8 to see the draft temperature matter)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the requests' nucleus sampling (temperature > 0)")
    parser.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.MEASURED.value)
    parser.add_argument("--sampler", choices=("tpe", "grid", "random"), default="tpe")
    parser.add_argument("--seed", type=int, default=0, help="sampler and load seed")
    parser.add_argument("--threads", type=int, default=None, help="server torch threads (default: torch's)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt file for the load")
    parser.add_argument("--storage", default=None, help="Optuna storage (default sqlite:///<out>/study.db)")


def check_args(args: argparse.Namespace) -> None:
    for ok, reason in [
        (args.trials >= 1, "--trials must be >= 1"),
        (args.remeasure >= 0 and args.compare_rounds >= 0, "--remeasure and --compare-rounds must be >= 0"),
        ((args.min_tokens is None or args.min_tokens >= 1) and args.min_steps >= 1,
         "--min-tokens and --min-steps must be >= 1"),
        (args.max_window_seconds > 0, "--max-window-seconds must be > 0"),
        (args.concurrency >= 1 and args.max_new_tokens >= 1, "--concurrency and --max-new-tokens must be >= 1"),
        (args.temperature >= 0, "--temperature must be >= 0"),
        (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
    ]:
        if not ok:
            raise UsageError(reason)


@dataclass
class Session:
    """What one demo session produced, for the report."""

    built: Assembled
    winner: PolicyScore | None
    compared: list[Compared]
    load: LoadSummary
    tune_seconds: float


def run(args: argparse.Namespace) -> int:
    check_args(args)
    out = args.out or Path("reports") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    storage_url = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    try:
        storage = open_storage(storage_url)
    except StorageError as e:
        raise UsageError(str(e)) from None
    prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
    if args.min_tokens is None:
        args.min_tokens = len(prompts) * args.max_new_tokens
    err = sys.stderr
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.monotonic()
    try:
        session = run_session(args, storage, prompts, err)
    except (ServerUnavailable, AdminRejected, NoTraffic, RuntimeError) as e:
        # RuntimeError: `moespec serve` did not start; its output is in the message.
        print(f"moespec demo: error: {type(e).__name__}: {e}", file=err)
        return 3 if isinstance(e, ServerUnavailable) else 5 if isinstance(e, NoTraffic) else 1

    dashboard = dashboard_hint(storage_url)
    extra = {
        "elapsed_seconds": round(time.monotonic() - started, 1),
        "tuning_seconds": round(session.tune_seconds, 1),
        "load": {**session.load.as_dict(), "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                 "temperature": args.temperature, "top_p": args.top_p, "prompts": str(args.prompts)},
        "settings": {"trials": args.trials, "remeasure": args.remeasure, "min_tokens": args.min_tokens,
                     "prompt_count": args.prompt_count,
                     "min_steps": args.min_steps, "objective": args.objective, "sampler": args.sampler,
                     "seed": args.seed},
    }
    built = session.built
    report = write_report(out, study=built.study, space=built.space, info=built.info, winner=session.winner,
                          compared=session.compared, storage_url=storage_url, dashboard=dashboard, extra=extra)
    _print_summary(session.compared, session.winner, report, dashboard)
    return 0 if session.winner is not None else 1


def run_session(args: argparse.Namespace, storage, prompts: list[str], err: TextIO) -> Session:
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
        server_args = ("--threads", str(args.threads)) if args.threads else ()
        server = stack.enter_context(start_server(telemetry_env(receiver.endpoint), token, server_args))
        print(f"demo: server on {server.address}; load: {args.concurrency} callers x {args.max_new_tokens} "
              f"tokens, temperature {args.temperature}", file=err, flush=True)
        client = stack.enter_context(MoespecClient(server.address, admin_token=token))
        client.wait_ready(timeout=60)
        load = LoadGenerator(client, prompts, LoadSpec(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                                       temperature=args.temperature, top_p=args.top_p,
                                                       seed=args.seed))
        load_thread = threading.Thread(target=load.run, args=(stop_load,), daemon=True, name="loadgen")
        load_thread.start()
        stack.callback(load_thread.join, 30)
        stack.callback(stop_load.set)

        settings = TuneSettings(
            study_name="demo",
            trials=args.trials,
            tuner_id=f"demo:{server.address}",
            objective=Objective(args.objective),
            sampler=SamplerKind(args.sampler),
            seed=args.seed,
            window=WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds),
            remeasure_top=args.remeasure,
            initial_design=InitialDesign.CORNERS,
        )
        admin = PolicyAdmin(client, server.address, retry_seconds=10)
        print(f"demo: sampler {rationale(settings.sampler)}", file=err, flush=True)
        built = assemble(settings, storage, admin, collector, ProgressPrinter(err, args.objective))
        tune_started = time.monotonic()
        winner = built.tuner.run()
        tune_seconds = time.monotonic() - tune_started

        compared = []
        if args.compare_rounds and winner is not None:
            print(f"demo: best vs plain vs default, {args.compare_rounds} interleaved rounds ...", file=err, flush=True)
            measurer = Measurer(admin, collector, MeasureConfig(
                window=settings.window, prune=PruneRule(factor=0), objective=Objective.MEASURED, cost=built.cost))
            policies = {"best": winner.policy, "plain": DraftPolicy(draft_length=0), "default": DEFAULT_POLICY}
            compared = compare(measurer, policies, args.compare_rounds, "demo/compare",
                               lambda n, r, v: print(f"  {n} round {r}: {v * 1e3:.3f} ms/tok", file=err, flush=True))
            admin.apply(winner.policy)  # leave the server on the winner
        stop_load.set()
        load_thread.join(30)
        return Session(built, winner, compared, load.summary(), tune_seconds)


def _print_summary(compared, winner, report: Path, dashboard: str) -> None:
    if winner is not None:
        print(f"winner: {winner.key.label()} ({winner.mean * 1e3:.3f} ms per committed token)")
    for c in compared:
        v = f"{c.seconds_per_token * 1e3:.3f} ms/tok" if c.stats.committed else "no tokens"
        print(f"  {c.name:8s} {policy_key(c.policy).label():20s} {v}")
    print(f"report: {report / 'report.md'}")
    print(f"open the study: {dashboard}")
