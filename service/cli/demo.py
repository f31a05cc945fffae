"""`moespec demo`: server + load + tuner on the embedded model, then a report folder.

The flags, their checks into DemoSettings, and the exit codes; the session itself (what it starts,
measures and writes) is tuner/drivers/demo.py. Exit codes: 0 a winner was found and reported, 1 no
winner (or `moespec serve` did not start), 2 bad arguments, 3 server unreachable, 5 no traffic.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import optuna

from service.errors import UsageError
from tuner.drivers.demo import DemoSettings, Session, run_session, write_session_report
from tuner.drivers.loadgen import DEFAULT_PROMPTS, first_prompts, load_prompts
from tuner.loop.sampler import SamplerKind
from tuner.loop.space import policy_key
from tuner.loop.study import StorageError, dashboard_hint, open_storage
from tuner.loop.tuning import NoTraffic
from tuner.measurement.admin import AdminRejected, ServerUnavailable
from tuner.measurement.window import Objective


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


def settings_from_args(args: argparse.Namespace, prompt_total: int) -> DemoSettings:
    """From flags check_args has passed; --min-tokens defaults to one pass over the `prompt_total`
    prompts the load cycles."""
    return DemoSettings(
        trials=args.trials,
        remeasure=args.remeasure,
        prompt_count=args.prompt_count,
        min_tokens=args.min_tokens if args.min_tokens is not None else prompt_total * args.max_new_tokens,
        min_steps=args.min_steps,
        max_window_seconds=args.max_window_seconds,
        compare_rounds=args.compare_rounds,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        objective=Objective(args.objective),
        sampler=SamplerKind(args.sampler),
        seed=args.seed,
        threads=args.threads,
        prompts=args.prompts,
    )


def run(args: argparse.Namespace) -> int:
    check_args(args)  # before the report folder is made
    out = args.out or Path("reports") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    storage_url = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    try:
        storage = open_storage(storage_url)
    except StorageError as e:
        raise UsageError(str(e)) from None
    prompts = first_prompts(load_prompts(args.prompts), args.prompt_count)
    demo = settings_from_args(args, len(prompts))
    err = sys.stderr
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.monotonic()
    try:
        session = run_session(demo, storage, prompts, err)
    except (ServerUnavailable, AdminRejected, NoTraffic, RuntimeError) as e:
        # RuntimeError: `moespec serve` did not start; its output is in the message.
        print(f"moespec demo: error: {type(e).__name__}: {e}", file=err)
        return 3 if isinstance(e, ServerUnavailable) else 5 if isinstance(e, NoTraffic) else 1

    dashboard = dashboard_hint(storage_url)
    report = write_session_report(out, session, demo, storage_url, dashboard, time.monotonic() - started)
    _print_summary(session, report, dashboard)
    return 0 if session.winner is not None else 1


def _print_summary(session: Session, report: Path, dashboard: str) -> None:
    winner = session.winner
    if winner is not None:
        print(f"winner: {winner.key.label()} ({winner.mean * 1e3:.3f} ms per committed token)")
    for c in session.compared:
        v = f"{c.seconds_per_token * 1e3:.3f} ms/tok" if c.stats.committed else "no tokens"
        print(f"  {c.name:8s} {policy_key(c.policy).label():20s} {v}")
    print(f"report: {report / 'report.md'}")
    print(f"open the study: {dashboard}")
