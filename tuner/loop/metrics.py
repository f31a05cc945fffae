"""The continuous tuner's own metrics: the incumbent (a gauge, one series labelled by the policy) and
a counter of decisions. Names from `otel.attributes` (TUNER_METRICS).

`TunerMetrics(meter)` takes any OpenTelemetry `Meter`; `otlp_meter_provider(endpoint)` builds the
one `moespec tune` uses (OTLP/gRPC to a Collector, which hands it to Prometheus in `deploy/`).
Nothing is installed globally; telemetry failures never stop the tuner (the SDK's exporter logs and
drops).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel import attributes as a


class TunerMetrics:
    def __init__(self, meter: Meter, study: str):
        self._study = study
        self._lock = threading.Lock()
        self._incumbent: tuple[float, dict[str, object]] | None = None
        meter.create_observable_gauge(a.TUNER_INCUMBENT.name, [self._observe], unit=a.TUNER_INCUMBENT.unit,
                                      description=a.TUNER_INCUMBENT.description)
        self._decisions = meter.create_counter(a.TUNER_DECISIONS.name, unit=a.TUNER_DECISIONS.unit,
                                               description=a.TUNER_DECISIONS.description)

    def incumbent(self, policy_id: str, label: str, value: float, epoch: int) -> None:
        attrs = {a.SPEC_POLICY_ID: policy_id, a.TUNER_POLICY: label, a.TUNER_EPOCH: epoch, a.TUNER_STUDY: self._study}
        with self._lock:
            self._incumbent = (value, attrs)

    def decision(self, kind: str) -> None:
        self._decisions.add(1, {a.TUNER_DECISION: kind, a.TUNER_STUDY: self._study})

    def _observe(self, _: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            current = self._incumbent
        return [] if current is None else [Observation(current[0], current[1])]


def otlp_meter_provider(endpoint: str, service_name: str = "moespec-tuner", interval_ms: int = 10_000):
    """A MeterProvider exporting OTLP/gRPC to `endpoint` every `interval_ms` (call .shutdown() at exit)."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    exporter = OTLPMetricExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=2)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    return MeterProvider(metric_readers=[reader], resource=Resource({a.RESOURCE_SERVICE_NAME: service_name}))
