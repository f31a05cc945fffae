"""OpenTelemetry for moespec: setup from the standard OTEL_* environment, spans and metrics.

Modules, one job each (importing this package imports none of them):
- api          the Telemetry / RequestObservation protocol the servicer calls
- attributes   every span name, attribute key, metric name and bucket list (the contract)
- config       TelemetryConfig from an explicit environment mapping (off when nothing is configured)
- cli          `moespec serve` flags mapped onto those variables; build_telemetry(args, environ, info)
- setup        providers, exporters and readers from a TelemetryConfig (no global providers)
- telemetry    OtelTelemetry (NoTelemetry in api): request span, verify spans, metrics per request
- spans        span attributes from the dataclasses; verify spans from StepRecords after the fact
- metrics      the instruments and how one result is recorded
- export       bounded, counting span export (never blocks generation)
- interceptors the gRPC aio server interceptor (continues a client's traceparent)
- receiver     a small OTLP/gRPC trace receiver (tests, tuner)
- quiet_logs   rate-limits the SDK exporters' repeated error logs (serve entry point only)
"""
