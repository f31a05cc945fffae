"""Telemetry configuration, read from an explicit environment mapping (never os.environ here).

The variables are the standard OpenTelemetry SDK ones, so the service is configured like any other
OTel-instrumented process. Two deliberate departures from the SDK defaults, both so that a bare
`moespec serve` neither exports nor waits on anything:
- nothing configured = telemetry off. Traces/metrics are exported only when an OTLP endpoint is set
  or OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER name an exporter explicitly;
- the OTLP export timeout defaults to 2 s (the SDK's 10 s would keep an export worker stuck that
  long on a dead collector; generation never waits on it either way, see otel.export).
The protocol defaults to grpc (the Collector's 4317 and the tuner's receiver speak it).
One moespec variable: MOESPEC_VERIFY_SPAN_RATIO, the share of verify steps that get a span.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from urllib.parse import unquote

DEFAULT_SERVICE_NAME = "moespec"
DEFAULT_EXPORT_TIMEOUT_MS = 2000
DEFAULT_VERIFY_SPAN_RATIO = 0.1
DEFAULT_ENDPOINTS = MappingProxyType({"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318"})
HTTP_PATHS = MappingProxyType({"traces": "/v1/traces", "metrics": "/v1/metrics"})

PROTOCOLS = ("grpc", "http/protobuf")
TRACES_EXPORTERS = ("otlp", "console", "none")
METRICS_EXPORTERS = ("otlp", "console", "prometheus", "none")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")

VERIFY_SPAN_RATIO_ENV = "MOESPEC_VERIFY_SPAN_RATIO"


class TelemetryConfigError(ValueError):
    """A variable (or the flag that set it) has a value we cannot use; the message names it."""


@dataclass(frozen=True)
class OtlpTarget:
    endpoint: str  # full URL; for http/protobuf it includes the /v1/<signal> path
    protocol: str  # "grpc" | "http/protobuf"
    insecure: bool  # grpc only: plaintext channel
    timeout_s: float
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str = DEFAULT_SERVICE_NAME
    resource_attributes: tuple[tuple[str, str], ...] = ()
    traces_exporters: tuple[str, ...] = ()  # subset of TRACES_EXPORTERS minus "none"; () = tracing off
    metrics_exporters: tuple[str, ...] = ()  # subset of METRICS_EXPORTERS minus "none"; () = metrics off
    traces_otlp: OtlpTarget | None = None
    metrics_otlp: OtlpTarget | None = None
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    bsp_schedule_delay_ms: int = 5000
    bsp_max_queue_size: int = 2048
    bsp_max_export_batch_size: int = 512
    bsp_export_timeout_ms: int = 30000
    metric_export_interval_ms: int = 60000
    metric_export_timeout_ms: int = 30000
    prometheus_host: str = "localhost"
    prometheus_port: int = 9464
    verify_span_ratio: float = DEFAULT_VERIFY_SPAN_RATIO

    @property
    def enabled(self) -> bool:
        return bool(self.traces_exporters or self.metrics_exporters)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TelemetryConfig:
        env = _Env(environ)
        if env.boolean("OTEL_SDK_DISABLED"):
            return cls()
        traces = env.exporters("OTEL_TRACES_EXPORTER", TRACES_EXPORTERS, default_otlp=env.has_endpoint("TRACES"))
        metrics = env.exporters("OTEL_METRICS_EXPORTER", METRICS_EXPORTERS, default_otlp=env.has_endpoint("METRICS"))
        sampler = env.choice("OTEL_TRACES_SAMPLER", SAMPLERS, "parentbased_always_on")
        ratio = env.number("OTEL_TRACES_SAMPLER_ARG", 1.0, lo=0.0, hi=1.0) if "ratio" in sampler else 1.0
        resource = env.pairs("OTEL_RESOURCE_ATTRIBUTES")
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or dict(resource).get("service.name") or DEFAULT_SERVICE_NAME,
            resource_attributes=resource,
            traces_exporters=traces,
            metrics_exporters=metrics,
            traces_otlp=env.otlp("traces") if "otlp" in traces else None,
            metrics_otlp=env.otlp("metrics") if "otlp" in metrics else None,
            sampler=sampler,
            sampler_arg=ratio,
            bsp_schedule_delay_ms=env.integer("OTEL_BSP_SCHEDULE_DELAY", 5000, lo=1),
            bsp_max_queue_size=env.integer("OTEL_BSP_MAX_QUEUE_SIZE", 2048, lo=1),
            bsp_max_export_batch_size=env.integer("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, lo=1),
            bsp_export_timeout_ms=env.integer("OTEL_BSP_EXPORT_TIMEOUT", 30000, lo=1),
            metric_export_interval_ms=env.integer("OTEL_METRIC_EXPORT_INTERVAL", 60000, lo=1),
            metric_export_timeout_ms=env.integer("OTEL_METRIC_EXPORT_TIMEOUT", 30000, lo=1),
            prometheus_host=env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost",
            prometheus_port=env.integer("OTEL_EXPORTER_PROMETHEUS_PORT", 9464, lo=0, hi=65535),
            verify_span_ratio=env.number(VERIFY_SPAN_RATIO_ENV, DEFAULT_VERIFY_SPAN_RATIO, lo=0.0, hi=1.0),
        )


class _Env:
    """Typed reads of one mapping; every error names the variable."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def get(self, name: str) -> str:
        return self.environ.get(name, "").strip()

    def boolean(self, name: str) -> bool:
        return self.get(name).lower() == "true"  # the spec: only "true" (any case) is true

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.get(name).lower() or default
        if value not in allowed:
            raise TelemetryConfigError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        return value

    def integer(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        raw = self.get(name)
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise TelemetryConfigError(f"{name}={raw!r}: expected an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise TelemetryConfigError(f"{name}={value}: expected a value in [{lo}, {hi if hi is not None else '...'}]")
        return value

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        raw = self.get(name)
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise TelemetryConfigError(f"{name}={raw!r}: expected a number") from None
        if not lo <= value <= hi:  # also refuses nan
            raise TelemetryConfigError(f"{name}={value}: expected a number in [{lo}, {hi}]")
        return value

    def pairs(self, name: str) -> tuple[tuple[str, str], ...]:
        """'k1=v1,k2=v2' with percent-encoded values (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS)."""
        out = []
        for item in filter(None, (p.strip() for p in self.get(name).split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise TelemetryConfigError(f"{name}: {item!r} is not key=value")
            out.append((unquote(key.strip()), unquote(value.strip())))
        return tuple(out)

    def exporters(self, name: str, allowed: tuple[str, ...], default_otlp: bool) -> tuple[str, ...]:
        raw = self.get(name).lower()
        if not raw:
            return ("otlp",) if default_otlp else ()
        names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
        bad = [n for n in names if n not in allowed]
        if bad:
            raise TelemetryConfigError(f"{name}={raw!r}: unknown exporter {bad[0]!r} (expected {', '.join(allowed)})")
        return () if "none" in names else names

    def has_endpoint(self, signal: str) -> bool:
        return bool(self.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or self.get("OTEL_EXPORTER_OTLP_ENDPOINT"))

    def signal(self, signal: str, suffix: str) -> tuple[str, str]:
        """Signal-specific variable first, then the generic one -> (variable name, value)."""
        specific = f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}"
        if self.get(specific):
            return specific, self.get(specific)
        return f"OTEL_EXPORTER_OTLP_{suffix}", self.get(f"OTEL_EXPORTER_OTLP_{suffix}")

    def otlp(self, signal: str) -> OtlpTarget:
        proto_var, protocol = self.signal(signal, "PROTOCOL")
        protocol = (protocol or "grpc").lower()
        if protocol not in PROTOCOLS:
            raise TelemetryConfigError(f"{proto_var}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        specific = self.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        generic = self.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINTS[protocol]
        if specific:
            endpoint = specific  # the spec: a signal-specific URL is used as given
        elif protocol == "http/protobuf":
            endpoint = generic.rstrip("/") + HTTP_PATHS[signal]
        else:
            endpoint = generic
        if "://" not in endpoint and protocol == "http/protobuf":
            raise TelemetryConfigError(f"OTLP {signal} endpoint {endpoint!r}: http/protobuf needs an http(s):// URL")
        _, insecure_raw = self.signal(signal, "INSECURE")
        # grpc: an http:// URL means plaintext; a bare host:port is plaintext only if asked for.
        insecure = endpoint.startswith("http://") or insecure_raw.lower() == "true"
        timeout_var, timeout_raw = self.signal(signal, "TIMEOUT")
        try:
            timeout_ms = int(timeout_raw) if timeout_raw else DEFAULT_EXPORT_TIMEOUT_MS
        except ValueError:
            raise TelemetryConfigError(f"{timeout_var}={timeout_raw!r}: expected milliseconds") from None
        if timeout_ms <= 0:
            raise TelemetryConfigError(f"{timeout_var}={timeout_ms}: expected a positive number of milliseconds")
        headers_var, _ = self.signal(signal, "HEADERS")
        return OtlpTarget(endpoint, protocol, insecure, timeout_ms / 1000, self.pairs(headers_var))
