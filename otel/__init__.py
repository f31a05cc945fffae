"""OpenTelemetry for moespec: setup from the standard OTEL_* environment, spans and metrics."""
