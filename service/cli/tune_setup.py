"""The parts `moespec tune` runs with, built from its checked flags: the study's storage and policy
claims, the span intake (receiver, collector, admission), the PolicyAdmin channel that follows a
restarted server, the optional metrics, and continuous mode. service/cli/tune.py owns the flags, the
order of things and the exit codes; this module builds, starts and tears down what they describe.
"""

from __future__ import annotations

import sys
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TextIO

from service.errors import UsageError
from service.security.redact import redact_url
from service.server.client import MoespecClient
from tuner.drivers.progress import ProgressPrinter, fmt_cost
from tuner.loop.assemble import Assembled, TuneSettings, assemble
from tuner.loop.claims import NoClaims, PolicyClaims, claims_for
from tuner.loop.continuous import ContinuousTuner
from tuner.loop.continuous_config import ContinuousConfig
from tuner.loop.fleet import Fleet
from tuner.loop.sampler import rationale
from tuner.loop.study import StorageError, open_storage
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.receiver_auth import IntakeSecurity
from tuner.measurement.span_admission import SpanAdmission
from tuner.measurement.spans import request_sample

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from optuna.storages import BaseStorage

    from otel.receiver import OtlpTraceReceiver


@dataclass(frozen=True)
class Endpoints:
    """Where the tuner's channels go, with their credentials: spans in, PolicyAdmin out, metrics out."""

    server: str
    otlp_listen: str  # as given, for messages
    listen_host: str
    listen_port: int
    intake: IntakeSecurity
    admin_token: str | None
    tls_ca: bytes | None
    tls_server_name: str | None
    connect_timeout: float
    metrics_endpoint: str | None  # None: no metrics


def open_study_storage(url: str) -> tuple[BaseStorage, PolicyClaims | NoClaims]:
    """The Optuna storage and, beside the study, the policy claims that let several workers share it."""
    try:
        storage = open_storage(url)
    except StorageError as e:
        raise UsageError(str(e)) from None
    try:
        claims = claims_for(url)
    except Exception as e:  # the same database open_storage just reached: only a broken one fails here
        raise UsageError(f"cannot open storage {redact_url(url)!r} for policy claims: "
                         f"{type(e).__name__}") from None
    return storage, claims


@dataclass
class TuneParts:
    """Everything `moespec tune` talks through, built but not yet started; `close` tears it down."""

    claims: PolicyClaims | NoClaims
    meter_provider: MeterProvider | None  # None: no --metrics-endpoint
    admission: SpanAdmission
    collector: SpanCollector
    receiver: OtlpTraceReceiver
    client: MoespecClient
    admin: PolicyAdmin
    printer: ProgressPrinter
    fleet: Fleet

    def close(self, err: TextIO) -> None:
        self.receiver.stop(grace=0.5)
        self.client.close()
        self.claims.close()
        _report_intake(self.receiver, self.collector, err)
        if self.meter_provider is not None:
            with suppress(Exception):
                self.meter_provider.shutdown()


def build_parts(endpoints: Endpoints, settings: TuneSettings, claims: PolicyClaims | NoClaims,
                err: TextIO) -> TuneParts:
    from otel.receiver import OtlpTraceReceiver  # grpc server machinery: only once the arguments are good

    meter_provider = _meter_provider(endpoints.metrics_endpoint)
    admission = SpanAdmission(log=lambda line: print(f"tuner: {line}", file=err, flush=True),
                              meter=meter_provider.get_meter("moespec.tuner") if meter_provider else None,
                              study=settings.study_name)
    collector = SpanCollector(request_sample, admit=admission.admit)
    intake = endpoints.intake
    receiver = OtlpTraceReceiver(endpoints.listen_host, endpoints.listen_port, on_spans=collector.on_spans,
                                 bearer_token=intake.bearer_token, tls_cert=intake.tls_cert, tls_key=intake.tls_key)
    client = MoespecClient(endpoints.server, admin_token=endpoints.admin_token, tls_ca=endpoints.tls_ca,
                           tls_server_name=endpoints.tls_server_name)
    admin = _admin_following_restarts(client, endpoints, admission)
    return TuneParts(claims, meter_provider, admission, collector, receiver, client, admin,
                     ProgressPrinter(err, settings.objective.value), Fleet(claims, settings.tuner_id))


def _admin_following_restarts(client: MoespecClient, endpoints: Endpoints, admission: SpanAdmission) -> PolicyAdmin:
    """PolicyAdmin whose restart hook re-points the span admission: a restarted server may come back
    under a new instance id, and spans of the old one must not count."""

    def follow_restart() -> None:
        admission.expect(admin.model_info().instance_id)

    admin = PolicyAdmin(client, endpoints.server, retry_seconds=endpoints.connect_timeout,
                        on_server_changed=follow_restart)
    return admin


def start(parts: TuneParts, settings: TuneSettings, storage, endpoints: Endpoints, storage_url: str,
          err: TextIO) -> Assembled:
    """Start the span receiver, assemble the search against the server, and say what was chosen."""
    try:
        parts.receiver.start()
    except (OSError, RuntimeError) as e:
        raise UsageError(f"--otlp-listen: cannot listen on {endpoints.otlp_listen}: {e}") from None
    guard = "bearer token required" if endpoints.intake.bearer_token else "no token: loopback only"
    print(f"tuner: receiving spans on {parts.receiver.endpoint} ({guard}); study {settings.study_name!r} in "
          f"{redact_url(storage_url)}", file=err, flush=True)
    print(f"tuner: sampler {rationale(settings.sampler)}", file=err, flush=True)
    if settings.whatif_recording is not None:
        there = "" if settings.whatif_recording.is_file() else " (not there yet: no hint until it is)"
        print(f"tuner: what-if hints from {settings.whatif_recording}{there}", file=err, flush=True)
    try:
        built = assemble(settings, storage, parts.admin, parts.collector, parts.printer, parts.fleet)
    except ValueError as e:  # the space asked for (--adaptive, --by-kind) is not what the server offers
        raise UsageError(f"the search space: {e}") from None
    parts.admission.expect(built.info.instance_id)
    bound = settings.policy_check_seconds + parts.admin.call_timeout
    print(f"tuner: worker {settings.tuner_id}; a restarted server gets its policy back within {bound:.0f} s "
          f"of answering again", file=err, flush=True)
    print(f"tuner: trials {built.mode.value} (backend {built.info.backend}, concurrent policies "
          f"{built.info.concurrent_policies}, policy switch {built.info.policy_switch_seconds:.2f} s)",
          file=err, flush=True)
    return built


def continuous_tuner(settings: TuneSettings, config: ContinuousConfig, storage, parts: TuneParts,
                     root: Assembled) -> ContinuousTuner:
    """Continuous mode after the search: `root` is the search just assembled; a re-opened search is
    assembled the same way under its own study name."""
    from tuner.loop.metrics import TunerMetrics

    provider = parts.meter_provider
    metrics = TunerMetrics(provider.get_meter("moespec.tuner"), settings.study_name) if provider else None

    def make(name: str, trials: int) -> Assembled:
        if name == settings.study_name:
            return root
        return assemble(replace(settings, study_name=name, trials=trials), storage, parts.admin, parts.collector,
                        parts.printer, parts.fleet)

    def log(d) -> None:
        print(f"tuner: decision {d.kind}: incumbent {d.policy} ({fmt_cost(d.value, settings.objective.value)}, "
              f"{d.policy_id}, epoch {d.epoch}): {d.reason}", file=sys.stderr, flush=True)

    def waiting(line: str) -> None:
        print(f"tuner: {line}", file=sys.stderr, flush=True)

    return ContinuousTuner(root.study, make, config, settings.trials, metrics, log, waiting)


def _meter_provider(endpoint: str | None):
    if not endpoint:
        return None
    from tuner.loop.metrics import otlp_meter_provider

    return otlp_meter_provider(endpoint)


def _report_intake(receiver: OtlpTraceReceiver, collector: SpanCollector, err: TextIO) -> None:
    """What the intake refused or dropped: a wrong token on the exporter side shows up here."""
    if receiver.rejected_exports:
        print(f"tuner: refused {receiver.rejected_exports} OTLP exports without the right bearer token",
              file=err, flush=True)
    dropped = collector.traffic().dropped_spans
    if dropped:
        print(f"tuner: dropped {dropped} request spans beyond a full trial window", file=err, flush=True)
