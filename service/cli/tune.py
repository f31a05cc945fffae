"""`moespec tune`: the online draft-policy tuner, as its own process.

It listens for the server's request spans on --otlp-listen (OTLP/gRPC), keeps its Optuna study in
--storage, and sets policies through PolicyAdmin. Environment read here, at run time:
MOESPEC_ADMIN_TOKEN (when neither --admin-token-file nor --admin-token is given). With --tls-ca the
tuner talks TLS to the server, so the token is never sent in plaintext.

--continuous keeps it running after the search (tuner/loop/continuous.py); its incumbent gauge goes to
--metrics-endpoint (default $OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT).

Exit codes: 0 done (winner applied), 2 bad arguments (incl. a storage URL that cannot be opened),
3 server unreachable, 4 admin token refused, 5 no traffic (trial windows kept starving), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from contextlib import suppress
from pathlib import Path

from service.errors import UsageError
from service.security import admin_token
from service.security.redact import redact_url
from service.server.client import MoespecClient
from tuner.drivers.progress import ProgressPrinter, fmt_cost
from tuner.loop.assemble import TuneSettings, assemble
from tuner.loop.claims import claims_for
from tuner.loop.continuous import ContinuousTuner
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.fleet import Fleet
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, rationale
from tuner.loop.study import StorageError, StudyMismatch, dashboard_hint, open_storage
from tuner.loop.tuning import NoTraffic
from tuner.measurement import receiver_auth
from tuner.measurement.admin import AdminRejected, PolicyAdmin, ServerUnavailable
from tuner.measurement.collector import SpanCollector
from tuner.measurement.measure import TrialMode
from tuner.measurement.receiver_auth import intake_security
from tuner.measurement.span_admission import SpanAdmission
from tuner.measurement.spans import request_sample
from tuner.measurement.window import Objective, WindowSpec

ADMIN_TOKEN_ENV = admin_token.ADMIN_TOKEN_ENV
DEFAULT_STORAGE = "sqlite:///moespec-tuner.db"
EXIT_UNREACHABLE, EXIT_REJECTED, EXIT_NO_TRAFFIC = 3, 4, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Tune the server's draft policy (drafter, draft length, draft temperature) online: each Optuna\n"
        "trial sets a policy, measures seconds per committed token from the request spans the server\n"
        "exports to --otlp-listen, and tells the value. The study lives in --storage, so the tuner can\n"
        "be stopped and restarted without losing a finished trial. Point the server's\n"
        "OTEL_EXPORTER_OTLP_ENDPOINT at http://<otlp-listen> (and set OTEL_BSP_SCHEDULE_DELAY=200\n"
        "or so: the SDK's 5 s batching delay makes every window 5 s longer)."
    )
    parser.epilog = ("exit codes: 0 done, 2 bad arguments or storage, 3 server unreachable, "
                     "4 admin token refused, 5 no traffic, 130 interrupted")
    parser.add_argument("--server", required=True, help="HOST:PORT of the moespec server")
    parser.add_argument("--otlp-listen", default="127.0.0.1:4317",
                        help="HOST:PORT the tuner's OTLP/gRPC trace receiver binds (default 127.0.0.1:4317)")
    parser.add_argument("--storage", default=DEFAULT_STORAGE,
                        help=f"Optuna storage: sqlite:///FILE, postgresql://..., mysql://..., journal:FILE or "
                             f"redis://... (default {DEFAULT_STORAGE})")
    parser.add_argument("--study", default="moespec", help="study name; the same name resumes it (default moespec)")
    parser.add_argument("--trials", type=int, default=30,
                        help="search trials the study should have in total; a restart continues to this number "
                             "(default 30; re-measurements come on top)")
    admin_token.add_arguments(parser, "for PolicyAdmin")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="FILE",
                        help="PEM file of the CA that signed the server's certificate: talk TLS to --server "
                             "(without it the channel, admin token included, is plaintext)")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="with --tls-ca: the name the server's certificate must carry, when --server's host "
                             "is another (an IP address, an internal alias)")
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
    parser.add_argument("--min-tokens", type=int, default=256, help="committed tokens a trial window needs")
    parser.add_argument("--min-steps", type=int, default=32, help="verify steps a trial window needs")
    parser.add_argument("--max-window-seconds", type=float, default=60.0,
                        help="a window still short of tokens after this long is told FAIL")
    parser.add_argument("--prune-factor", type=float, default=1.5,
                        help="prune a trial whose running cost exceeds this x the incumbent's (0 = never)")
    parser.add_argument("--remeasure", type=int, default=3, help="re-measure the best N policies before the winner")
    parser.add_argument("--max-failures", type=int, default=3,
                        help="stop after this many starved windows in a row (exit 5)")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to keep retrying an unreachable server before giving up (exit 3)")
    parser.add_argument("--tuner-id", default=None,
                        help="identity for crash recovery: a restarted tuner with the same id fails its own "
                             "unfinished trial at once (default HOSTNAME:SERVER); one per worker of a fleet")
    parser.add_argument("--stale-seconds", type=float, default=120.0,
                        help="fleet: another worker's running trial without a heartbeat for this long is failed "
                             "(its worker died), never counted (default 120; heartbeats every "
                             "second or so while a trial runs)")
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
    receiver_auth.add_arguments(parser)
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


def continuous_config(args: argparse.Namespace) -> ContinuousConfig:
    return ContinuousConfig(exploration_share=args.exploration_share, reopen_trials=args.reopen_trials)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    parse_hostport(args.server, "--server", allow_zero=False)
    listen_host, listen_port = parse_hostport(args.otlp_listen, "--otlp-listen", allow_zero=True)
    token = admin_token.resolve(args, os.environ)
    security = intake_security(args, os.environ, listen_host)
    if args.tls_server_name and args.tls_ca is None:
        raise UsageError("--tls-server-name needs --tls-ca")
    tls_ca = _read_ca(args.tls_ca)
    err = sys.stderr
    if threading.current_thread() is threading.main_thread():
        # SIGTERM takes the Ctrl-C path: the running trial is told FAIL and the incumbent restored.
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        storage = open_storage(args.storage)
    except StorageError as e:
        raise UsageError(str(e)) from None

    try:
        claims = claims_for(args.storage)  # policy claims beside the study: several workers may share it
    except Exception as e:  # the same database open_storage just reached: only a broken one fails here
        raise UsageError(f"cannot open storage {redact_url(args.storage)!r} for policy claims: "
                         f"{type(e).__name__}") from None

    from otel.receiver import OtlpTraceReceiver  # grpc server machinery: only once the arguments are good

    metrics_endpoint = (args.metrics_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    meter_provider = _meter_provider(metrics_endpoint)
    admission = SpanAdmission(log=lambda line: print(f"tuner: {line}", file=err, flush=True),
                              meter=meter_provider.get_meter("moespec.tuner") if meter_provider else None,
                              study=settings.study_name)
    collector = SpanCollector(request_sample, admit=admission.admit)
    receiver = OtlpTraceReceiver(listen_host, listen_port, on_spans=collector.on_spans,
                                 bearer_token=security.bearer_token, tls_cert=security.tls_cert,
                                 tls_key=security.tls_key)
    client = MoespecClient(args.server, admin_token=token, tls_ca=tls_ca, tls_server_name=args.tls_server_name)

    def follow_restart() -> None:  # a restarted server may come back under a new instance id
        admission.expect(admin.model_info().instance_id)

    admin = PolicyAdmin(client, args.server, retry_seconds=args.connect_timeout, on_server_changed=follow_restart)
    printer = ProgressPrinter(err, settings.objective.value)
    fleet = Fleet(claims, settings.tuner_id)
    built = None
    continuous = None
    try:
        try:
            receiver.start()
        except (OSError, RuntimeError) as e:
            raise UsageError(f"--otlp-listen: cannot listen on {args.otlp_listen}: {e}") from None
        guard = "bearer token required" if security.bearer_token else "no token: loopback only"
        print(f"tuner: receiving spans on {receiver.endpoint} ({guard}); study {settings.study_name!r} in "
              f"{redact_url(args.storage)}", file=err, flush=True)
        print(f"tuner: sampler {rationale(settings.sampler)}", file=err, flush=True)
        if settings.whatif_recording is not None:
            there = "" if settings.whatif_recording.is_file() else " (not there yet: no hint until it is)"
            print(f"tuner: what-if hints from {settings.whatif_recording}{there}", file=err, flush=True)
        try:
            built = assemble(settings, storage, admin, collector, printer, fleet)
        except ValueError as e:  # the space asked for (--adaptive, --by-kind) is not what the server offers
            raise UsageError(f"the search space: {e}") from None
        admission.expect(built.info.instance_id)
        bound = settings.policy_check_seconds + admin.call_timeout
        print(f"tuner: worker {settings.tuner_id}; a restarted server gets its policy back within {bound:.0f} s "
              f"of answering again", file=err, flush=True)
        print(f"tuner: trials {built.mode.value} (backend {built.info.backend}, concurrent policies "
              f"{built.info.concurrent_policies}, policy switch {built.info.policy_switch_seconds:.2f} s)",
              file=err, flush=True)
        if args.continuous:
            continuous = _continuous(args, settings, storage, admin, collector, printer, built, meter_provider,
                                     fleet)
            continuous.run(threading.Event())  # returns only through SIGTERM / Ctrl-C
            return 0
        best = built.tuner.run()
    except StudyMismatch as e:
        raise UsageError(str(e)) from None
    except StorageError as e:
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
        # The interrupted trial is already told FAIL (trial.TrialRunner); leave the server on the best
        # (in continuous mode: the saved incumbent, which a restart keeps).
        with suppress(Exception):
            if continuous is not None and continuous.incumbent is not None:
                continuous.restore()
            elif built is not None:
                built.tuner.apply_incumbent()
        print("moespec tune: interrupted; the study resumes where it stopped", file=err)
        return 130
    finally:
        receiver.stop(grace=0.5)
        client.close()
        claims.close()
        _report_intake(receiver, collector, err)
        if meter_provider is not None:
            with suppress(Exception):
                meter_provider.shutdown()
    if best is None:
        print("moespec tune: no trial completed; nothing applied", file=err)
        return EXIT_NO_TRAFFIC
    print(f"best policy: {best.key.label()} ({fmt_cost(best.mean, settings.objective.value)}, "
          f"policy id {best.policy.policy_id})")
    print(f"open the study: {dashboard_hint(args.storage)}")
    return 0


def _meter_provider(endpoint: str | None):
    if not endpoint:
        return None
    from tuner.loop.metrics import otlp_meter_provider

    return otlp_meter_provider(endpoint)


def _continuous(args, settings, storage, admin, collector, printer, root, provider, fleet):
    from dataclasses import replace

    from tuner.loop.metrics import TunerMetrics

    metrics = TunerMetrics(provider.get_meter("moespec.tuner"), settings.study_name) if provider else None

    def make(name: str, trials: int):
        if name == settings.study_name:
            return root
        return assemble(replace(settings, study_name=name, trials=trials), storage, admin, collector, printer,
                        fleet)

    def log(d) -> None:
        print(f"tuner: decision {d.kind}: incumbent {d.policy} ({fmt_cost(d.value, settings.objective.value)}, "
              f"{d.policy_id}, epoch {d.epoch}): {d.reason}", file=sys.stderr, flush=True)

    def waiting(line: str) -> None:
        print(f"tuner: {line}", file=sys.stderr, flush=True)

    return ContinuousTuner(root.study, make, continuous_config(args), settings.trials, metrics, log, waiting)


def _report_intake(receiver, collector: SpanCollector, err) -> None:
    """What the intake refused or dropped: a wrong token on the exporter side shows up here."""
    if receiver.rejected_exports:
        print(f"tuner: refused {receiver.rejected_exports} OTLP exports without the right bearer token",
              file=err, flush=True)
    dropped = collector.traffic().dropped_spans
    if dropped:
        print(f"tuner: dropped {dropped} request spans beyond a full trial window", file=err, flush=True)


def _read_ca(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"--tls-ca: cannot read {path}: {e.strerror}") from None


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
