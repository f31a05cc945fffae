"""`moespec tune`: the online draft-policy tuner, as its own process.

It listens for the server's request spans on --otlp-listen (OTLP/gRPC), keeps its Optuna study in
--storage, and sets policies through PolicyAdmin. Environment read here, at run time:
MOESPEC_ADMIN_TOKEN (when neither --admin-token-file nor --admin-token is given). With --tls-ca the
tuner talks TLS to the server, so the token is never sent in plaintext.

--continuous keeps it running after the search (tuner/loop/continuous.py); its incumbent gauge goes to
--metrics-endpoint (default $OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT).

Exit codes: 0 done (winner applied), 2 bad arguments (incl. a storage URL that cannot be opened),
3 server unreachable, 4 admin token refused, 5 no traffic (trial windows kept starving), 130 interrupted.

Here: the flags, their checks into TuneSettings and Endpoints, the order of things and the exit
codes. The parts it runs with (storage, span intake, PolicyAdmin, continuous mode) are built and torn
down by service/cli/tune_setup.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import TextIO

from service.cli.tune_setup import (
    Endpoints,
    TuneParts,
    build_parts,
    continuous_tuner,
    open_study_storage,
    start,
)
from service.errors import UsageError
from service.security import admin_token
from tuner.drivers.progress import fmt_cost
from tuner.loop.assemble import Assembled, TuneSettings
from tuner.loop.continuous import ContinuousTuner
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind
from tuner.loop.study import PolicyScore, StorageError, StudyMismatch, dashboard_hint
from tuner.loop.tuning import NoTraffic
from tuner.measurement import receiver_auth
from tuner.measurement.admin import AdminRejected, ServerUnavailable
from tuner.measurement.measure import TrialMode
from tuner.measurement.receiver_auth import intake_security
from tuner.measurement.window import Objective, WindowSpec

ADMIN_TOKEN_ENV = admin_token.ADMIN_TOKEN_ENV
DEFAULT_STORAGE = "sqlite:///moespec-tuner.db"
EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_NO_TRAFFIC = 3, 4, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The order of the calls is the order of --help.
    _describe(parser)
    _add_endpoint_arguments(parser)
    _add_study_arguments(parser)
    _add_server_credential_arguments(parser)
    _add_search_arguments(parser)
    _add_trial_window_arguments(parser)
    _add_recovery_arguments(parser)
    _add_paired_and_continuous_arguments(parser)
    receiver_auth.add_arguments(parser)
    _add_cost_arguments(parser)


def _describe(parser: argparse.ArgumentParser) -> None:
    """What `moespec tune --help` says above and below the flags."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Tune the server's draft policy (drafter, draft length, draft temperature, and tree width where\n"
        "the server drafts trees) online: each Optuna trial sets a policy, measures seconds per committed\n"
        "token from the request spans the server exports to --otlp-listen, and tells the value. The study\n"
        "lives in --storage, so the tuner can be stopped and restarted without losing a finished trial.\n"
        "Point the server's OTEL_EXPORTER_OTLP_ENDPOINT at http://<otlp-listen> (and set\n"
        "OTEL_BSP_SCHEDULE_DELAY=200 or so: the SDK's 5 s batching delay makes every window 5 s longer)."
    )
    parser.epilog = ("exit codes: 0 done, 2 bad arguments or storage, 3 server unreachable, "
                     "4 admin token refused, 5 no traffic, 130 interrupted")


def _add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server is and where the tuner's span receiver listens."""
    parser.add_argument("--server", required=True, help="HOST:PORT of the moespec server")
    parser.add_argument("--otlp-listen", default="127.0.0.1:4317",
                        help="HOST:PORT the tuner's OTLP/gRPC trace receiver binds (default 127.0.0.1:4317)")


def _add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the Optuna study lives, its name, and how many search trials it should hold."""
    parser.add_argument("--storage", default=DEFAULT_STORAGE,
                        help=f"Optuna storage: sqlite:///FILE, postgresql://..., mysql://..., journal:FILE or "
                             f"redis://... (default {DEFAULT_STORAGE})")
    parser.add_argument("--study", default="moespec", help="study name; the same name resumes it (default moespec)")
    parser.add_argument("--trials", type=int, default=30,
                        help="search trials the study should have in total; a restart continues to this number "
                             "(default 30; re-measurements come on top)")


def _add_server_credential_arguments(parser: argparse.ArgumentParser) -> None:
    """How the tuner talks to PolicyAdmin: the admin token and TLS."""
    admin_token.add_arguments(parser, "for PolicyAdmin")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="FILE",
                        help="PEM file of the CA that signed the server's certificate: talk TLS to --server "
                             "(without it the channel, admin token included, is plaintext)")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="with --tls-ca: the name the server's certificate must carry, when --server's host "
                             "is another (an IP address, an internal alias)")


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """What the search optimises, how it samples, and which policies it may propose."""
    parser.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.MEASURED.value,
                        help="measured: seconds per committed token; modelled: weight bytes touched per token")
    parser.add_argument("--sampler", choices=[s.value for s in SamplerKind], default=SamplerKind.TPE.value,
                        help="tpe (default; see tuner/loop/sampler.py for why), grid (exhaustive), random")
    parser.add_argument("--seed", type=int, default=None, help="sampler seed")
    parser.add_argument("--initial-design", choices=[d.value for d in InitialDesign],
                        default=InitialDesign.CORNERS.value,
                        help="what a fresh TPE study measures first: corners = plain, each drafter at the longest "
                             "and a short length, the model drafter at T=0 (default); baselines = plain, the "
                             "default policy, n-gram k=3")
    parser.add_argument("--adaptive", action="store_true",
                        help="search the moespec draft-length rule (its cost weight) beside static policies")
    parser.add_argument("--by-kind", action="store_true",
                        help="search tables: one policy for greedy requests, one for sampled requests")


def _add_trial_window_arguments(parser: argparse.ArgumentParser) -> None:
    """How much traffic a trial window needs, when to prune, re-measure or give up."""
    parser.add_argument("--min-tokens", type=int, default=256, help="committed tokens a trial window needs")
    parser.add_argument("--min-steps", type=int, default=32, help="verify steps a trial window needs")
    parser.add_argument("--max-window-seconds", type=float, default=60.0,
                        help="a window still short of tokens after this long is told FAIL")
    parser.add_argument("--prune-factor", type=float, default=1.5,
                        help="prune a trial whose running cost exceeds this x the incumbent's (0 = never)")
    parser.add_argument("--remeasure", type=int, default=3, help="re-measure the best N policies before the winner")
    parser.add_argument("--max-failures", type=int, default=3,
                        help="stop after this many starved windows in a row (exit 5)")


def _add_recovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Riding out an unreachable server, a crashed tuner, and dead fleet workers."""
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to keep retrying an unreachable server before giving up (exit 3)")
    parser.add_argument("--tuner-id", default=None,
                        help="identity for crash recovery: a restarted tuner with the same id fails its own "
                             "unfinished trial at once (default HOSTNAME:SERVER); one per worker of a fleet")
    parser.add_argument("--stale-seconds", type=float, default=120.0,
                        help="fleet: another worker's running trial without a heartbeat for this long is failed "
                             "(its worker died), never counted (default 120; heartbeats every "
                             "second or so while a trial runs)")


def _add_paired_and_continuous_arguments(parser: argparse.ArgumentParser) -> None:
    """How a trial shares the traffic with the incumbent, and the continuous mode after the search."""
    pairing = parser.add_argument_group("paired trials and continuous mode")
    pairing.add_argument("--trial-mode", choices=["auto", *(m.value for m in TrialMode)], default="auto",
                         help="paired: candidate beside the incumbent in one traffic split; interleaved: "
                              "control/candidate/control windows (backends with one policy at a time); "
                              "sequential: the candidate alone (drift goes into its value). auto (default): "
                              "paired where GetModelInfo.concurrent_policies, else interleaved; sequential for "
                              "--objective modelled")
    pairing.add_argument("--candidate-share", type=float, default=0.5,
                         help="share of the requests the candidate gets in a paired trial, in (0, 0.5] "
                              "(default 0.5); a bad candidate hurts only its share")
    pairing.add_argument("--switch-window-factor", type=float, default=10.0,
                         help="every window lasts at least this x GetModelInfo.policy_switch_seconds, so "
                              "policy switches (SGLang restarts its engine) cost at most ~1/x of the time")
    pairing.add_argument("--continuous", action="store_true",
                         help="after the search keep running: challengers at --exploration-share beside the "
                              "incumbent, promotion with confidence, the search re-opens on a workload shift; "
                              "stops only on SIGTERM / Ctrl-C")
    pairing.add_argument("--exploration-share", type=float, default=0.1,
                         help="continuous mode: share of the requests the challenger gets, in (0, 0.5] (default 0.1)")
    pairing.add_argument("--reopen-trials", type=int, default=12,
                         help="continuous mode: search trials when the search re-opens (default 12)")
    pairing.add_argument("--metrics-endpoint", default=None,
                         help="OTLP/gRPC endpoint for the tuner's metrics (moespec.tuner.incumbent); default "
                              "$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; none = off")


def _add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Inputs of the predicted and modelled costs: what-if hints, fixed bytes, expert parallelism."""
    parser.add_argument("--whatif-recording", type=Path, default=None, metavar="FILE",
                        help="the server's --record-steps FILE (same machine): after each measured trial at draft "
                             "length k, replay its recorded steps, store the predicted cost of every k' <= k in the "
                             "trial's user attributes and queue the predicted best shorter length next "
                             "(a missing or unreadable file is logged, never fatal)")
    parser.add_argument("--fixed-bytes-per-pass", type=int, default=None,
                        help="modelled cost: bytes every verify pass reads besides routed experts "
                             "(default: shared experts at routed-expert size, a lower bound)")
    parser.add_argument("--ep-size", type=int, default=0,
                        help="the server estimates expert parallelism over P ranks (moespec serve --ep-size P): "
                             "the modelled cost adds its all-to-all bytes (dispatch + combine) per token")


def parse_hostport(value: str, flag: str, allow_zero: bool) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise UsageError(f"{flag} must be HOST:PORT, got {value!r}")
    port = int(port_text)
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise UsageError(f"{flag}: port out of range in {value!r}")
    return host, port


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    _check_numbers(args)
    if "/" in args.study or not args.study:
        raise UsageError("--study must be a non-empty name without '/' (policy ids are <study>/<trial>)")
    return TuneSettings(
        study_name=args.study,
        trials=args.trials,
        tuner_id=args.tuner_id or f"{socket.gethostname()}:{args.server}",
        objective=Objective(args.objective),
        sampler=SamplerKind(args.sampler),
        seed=args.seed,
        window=WindowSpec(args.min_tokens, args.min_steps, args.max_window_seconds),
        prune=PruneRule(factor=args.prune_factor),
        remeasure_top=args.remeasure,
        max_consecutive_failures=args.max_failures,
        stale_seconds=args.stale_seconds,
        fixed_bytes_per_pass=args.fixed_bytes_per_pass,
        trial_mode=None if args.trial_mode == "auto" else TrialMode(args.trial_mode),
        candidate_share=args.candidate_share,
        switch_window_factor=args.switch_window_factor,
        ep_size=args.ep_size,
        whatif_recording=args.whatif_recording,
        initial_design=InitialDesign(args.initial_design),
        adaptive=args.adaptive,
        by_kind=args.by_kind,
    )


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [
        (args.trials >= 1, "--trials must be >= 1"),
        (args.min_tokens >= 1 and args.min_steps >= 1, "--min-tokens and --min-steps must be >= 1"),
        (args.max_window_seconds > 0, "--max-window-seconds must be > 0"),
        (args.prune_factor == 0 or args.prune_factor > 1, "--prune-factor must be > 1 (or 0 to disable)"),
        (args.remeasure >= 0 and args.max_failures >= 1, "--remeasure must be >= 0 and --max-failures >= 1"),
        (args.connect_timeout >= 0, "--connect-timeout must be >= 0"),
        (0 < args.candidate_share <= 0.5, "--candidate-share must be in (0, 0.5]"),
        (0 < args.exploration_share <= 0.5, "--exploration-share must be in (0, 0.5]"),
        (args.switch_window_factor >= 0, "--switch-window-factor must be >= 0"),
        (args.reopen_trials >= 1, "--reopen-trials must be >= 1"),
        (args.ep_size >= 0, "--ep-size must be >= 1 (or 0 for off)"),
        (args.stale_seconds > 0, "--stale-seconds must be > 0"),
    ]
    for ok, reason in checks:
        if not ok:
            raise UsageError(reason)


def continuous_config(args: argparse.Namespace) -> ContinuousConfig:
    return ContinuousConfig(exploration_share=args.exploration_share, reopen_trials=args.reopen_trials)


def endpoints_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Endpoints:
    """The checked addresses and credentials; files named by flags are read here, so a bad one is exit 2."""
    parse_hostport(args.server, "--server", allow_zero=False)
    listen_host, listen_port = parse_hostport(args.otlp_listen, "--otlp-listen", allow_zero=True)
    token = admin_token.resolve(args, environ)
    intake = intake_security(args, environ, listen_host)
    if args.tls_server_name and args.tls_ca is None:
        raise UsageError("--tls-server-name needs --tls-ca")
    metrics_endpoint = (args.metrics_endpoint or environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return Endpoints(server=args.server, otlp_listen=args.otlp_listen, listen_host=listen_host,
                     listen_port=listen_port, intake=intake, admin_token=token, tls_ca=_read_ca(args.tls_ca),
                     tls_server_name=args.tls_server_name, connect_timeout=args.connect_timeout,
                     metrics_endpoint=metrics_endpoint)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    endpoints = endpoints_from_args(args, os.environ)
    err = sys.stderr
    if threading.current_thread() is threading.main_thread():
        # SIGTERM takes the Ctrl-C path: the running trial is told FAIL and the incumbent restored.
        signal.signal(signal.SIGTERM, _raise_interrupt)
    storage, claims = open_study_storage(args.storage)
    parts = build_parts(endpoints, settings, claims, err)
    return _tune(args, settings, endpoints, storage, parts, err)


def _tune(args: argparse.Namespace, settings: TuneSettings, endpoints: Endpoints, storage, parts: TuneParts,
          err: TextIO) -> int:
    """The search (and, with --continuous, what follows it) to its end; each way it can end has its exit code."""
    built = continuous = None
    try:
        built = start(parts, settings, storage, endpoints, args.storage, err)
        if args.continuous:
            continuous = continuous_tuner(settings, continuous_config(args), storage, parts, built)
            continuous.run(threading.Event())  # returns only through SIGTERM / Ctrl-C
            return 0
        best = built.tuner.run()
    except (StudyMismatch, StorageError) as e:
        raise UsageError(str(e)) from None
    except ServerUnavailable as e:
        print(f"moespec tune: error: server unreachable: {e}", file=err)
        return EXIT_UNREACHABLE
    except AdminRejected as e:
        print(f"moespec tune: error: {e}", file=err)
        return EXIT_REJECTED
    except NoTraffic as e:
        print(f"moespec tune: error: {e}", file=err)
        with suppress(Exception):
            built.tuner.apply_incumbent()
        return EXIT_NO_TRAFFIC
    except KeyboardInterrupt:
        _leave_the_incumbent_applied(built, continuous)
        print("moespec tune: interrupted; the study resumes where it stopped", file=err)
        return 130
    finally:
        parts.close(err)
    return _report_best(best, settings, args.storage, err)


def _leave_the_incumbent_applied(built: Assembled | None, continuous: ContinuousTuner | None) -> None:
    # The interrupted trial is already told FAIL (trial.TrialRunner); leave the server on the best
    # (in continuous mode: the saved incumbent, which a restart keeps).
    with suppress(Exception):
        if continuous is not None and continuous.incumbent is not None:
            continuous.restore()
        elif built is not None:
            built.tuner.apply_incumbent()


def _report_best(best: PolicyScore | None, settings: TuneSettings, storage_url: str, err: TextIO) -> int:
    if best is None:
        print("moespec tune: no trial completed; nothing applied", file=err)
        return EXIT_NO_TRAFFIC
    print(f"best policy: {best.key.label()} ({fmt_cost(best.mean, settings.objective.value)}, "
          f"policy id {best.policy.policy_id})")
    print(f"open the study: {dashboard_hint(storage_url)}")
    return 0


def _read_ca(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"--tls-ca: cannot read {path}: {e.strerror}") from None


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
