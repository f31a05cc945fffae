"""`moespec serve` telemetry flags: each one is a spelling of a standard environment variable.

A flag given on the command line overrides the variable; an absent flag leaves the environment's
value. The resulting mapping goes through the same TelemetryConfig.from_environ as the plain
environment, so flags and variables can never disagree about meaning or validation.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from otel.config import (
    METRICS_EXPORTERS,
    PROTOCOLS,
    SAMPLERS,
    TRACES_EXPORTERS,
    VERIFY_SPAN_RATIO_ENV,
    TelemetryConfig,
    TelemetryConfigError,
)
from otel.quiet_logs import quiet_exporter_logs
from otel.setup import build_telemetry_from_config
from service.types import ModelInfo

# (flag, environment variable, argparse keyword arguments)
FLAGS: tuple[tuple[str, str, dict], ...] = (
    ("--otel-service-name", "OTEL_SERVICE_NAME", dict(metavar="NAME", help="service.name (default moespec)")),
    ("--otel-endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT",
     dict(metavar="URL", help="OTLP endpoint, e.g. http://collector:4317; setting it turns export on")),
    ("--otel-protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", dict(choices=PROTOCOLS, help="OTLP protocol (default grpc)")),
    ("--otel-traces-exporter", "OTEL_TRACES_EXPORTER",
     dict(metavar="LIST", help=f"comma list of {', '.join(TRACES_EXPORTERS)} (console prints spans, for debugging)")),
    ("--otel-metrics-exporter", "OTEL_METRICS_EXPORTER",
     dict(metavar="LIST", help=f"comma list of {', '.join(METRICS_EXPORTERS)}")),
    ("--otel-traces-sampler", "OTEL_TRACES_SAMPLER", dict(choices=SAMPLERS, help="request trace sampler")),
    ("--otel-traces-sampler-arg", "OTEL_TRACES_SAMPLER_ARG", dict(metavar="RATIO", help="ratio for *traceidratio")),
    ("--otel-export-timeout", "OTEL_EXPORTER_OTLP_TIMEOUT",
     dict(metavar="MS", help="OTLP export timeout in milliseconds (default 2000)")),
    ("--otel-bsp-max-queue-size", "OTEL_BSP_MAX_QUEUE_SIZE",
     dict(metavar="N", help="spans buffered for export; beyond it spans are dropped and counted (default 2048)")),
    ("--otel-bsp-schedule-delay", "OTEL_BSP_SCHEDULE_DELAY",
     dict(metavar="MS", help="span batch delay (default 5000)")),
    ("--otel-metric-export-interval", "OTEL_METRIC_EXPORT_INTERVAL",
     dict(metavar="MS", help="OTLP metric export interval (default 60000)")),
    ("--prometheus-host", "OTEL_EXPORTER_PROMETHEUS_HOST",
     dict(metavar="HOST", help="Prometheus scrape endpoint address (default localhost)")),
    ("--verify-span-ratio", VERIFY_SPAN_RATIO_ENV,
     dict(metavar="RATIO", help="share of verify steps that get a span, 0..1 (default 0.1); request spans "
                                "and metrics always cover every step")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "telemetry", "OpenTelemetry export; each flag overrides the OTEL_* variable it names. Off unless an "
                     "endpoint or exporter is configured.")
    for flag, var, kwargs in FLAGS:
        group.add_argument(flag, dest=_dest(flag), default=None, **{**kwargs, "help": f"{kwargs['help']} [{var}]"})
    group.add_argument("--prometheus-port", dest="otel_prometheus_port", default=None, metavar="PORT",
                       help="serve Prometheus metrics on this port (adds prometheus to the metrics exporters) "
                            "[OTEL_EXPORTER_PROMETHEUS_PORT]")
    group.add_argument("--otel-disabled", dest="otel_disabled", action="store_true",
                       help="turn telemetry off whatever the environment says [OTEL_SDK_DISABLED]")


def environ_with_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    env = dict(environ)
    for flag, var, _ in FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is not None:
            env[var] = str(value)
    port = getattr(args, "otel_prometheus_port", None)
    if port is not None:
        env["OTEL_EXPORTER_PROMETHEUS_PORT"] = str(port)
        current = env.get("OTEL_METRICS_EXPORTER", "").strip()
        if not current:  # keep the implicit otlp exporter an endpoint would have switched on
            has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
            current = "otlp" if has_endpoint else ""
        names = [n for n in current.split(",") if n.strip() and n.strip() != "none"]
        env["OTEL_METRICS_EXPORTER"] = ",".join([*names, "prometheus"])
    if getattr(args, "otel_disabled", False):
        env["OTEL_SDK_DISABLED"] = "true"
    return env


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> TelemetryConfig:
    """Raises service.errors.UsageError (exit 2, one line) on a bad flag or variable."""
    try:
        return TelemetryConfig.from_environ(environ_with_flags(args, environ))
    except TelemetryConfigError as e:
        from service.errors import UsageError

        raise UsageError(f"telemetry: {e}") from None


def build_telemetry(args: argparse.Namespace, environ: Mapping[str, str], info: ModelInfo):
    """The Telemetry for `moespec serve`; give its `server_interceptors()` to grpc.aio.server.

    As the serving application's entry point it also installs the exporter log filter (otel.quiet_logs).
    """
    config = config_from_args(args, environ)
    if config.enabled:
        quiet_exporter_logs()
    return build_telemetry_from_config(config, info)


def _dest(flag: str) -> str:
    # Every dest starts with otel_ so the flags cannot collide with serve's own options.
    name = flag.lstrip("-").replace("-", "_")
    return name if name.startswith("otel_") else f"otel_{name}"
