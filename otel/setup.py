"""Build a Telemetry from a TelemetryConfig: providers, exporters, readers. No globals are set.

Every exporter and reader is constructed with explicit arguments taken from the config, so the SDK's
own environment lookups only fill in what the config does not cover (TLS certificate files,
compression). Spans go through otel.export's bounded, counting processor.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import (
    TELEMETRY_SDK_LANGUAGE,
    TELEMETRY_SDK_NAME,
    TELEMETRY_SDK_VERSION,
    Resource,
)
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.version import __version__ as sdk_version

from otel import attributes as a
from otel.aggregate import batching_works, histogram_view
from otel.api import NoTelemetry
from otel.config import OtlpTarget, TelemetryConfig
from otel.deferred import deferral_works
from otel.export import BoundedSpanProcessor, CountingSpanExporter, ExportStats
from otel.telemetry import INSTRUMENTATION_SCOPE, OtelTelemetry
from service.types import ModelInfo

logger = logging.getLogger(__name__)


def build_resource(config: TelemetryConfig, info: ModelInfo) -> Resource:
    attrs = {TELEMETRY_SDK_LANGUAGE: "python", TELEMETRY_SDK_NAME: "opentelemetry", TELEMETRY_SDK_VERSION: sdk_version}
    attrs.update(config.resource_attributes)
    attrs.update({
        a.RESOURCE_SERVICE_NAME: config.service_name,
        a.RESOURCE_MODEL_NAME: info.model_name,
        a.RESOURCE_BACKEND: info.backend,
    })
    if info.draft_model_name:
        attrs[a.RESOURCE_DRAFT_MODEL_NAME] = info.draft_model_name
    if info.device:
        attrs[a.RESOURCE_DEVICE] = info.device
    if info.instance_id:
        attrs[a.RESOURCE_SERVICE_INSTANCE_ID] = info.instance_id
    return Resource(attrs)  # not Resource.create: that would read OTEL_* from os.environ


def build_sampler(config: TelemetryConfig) -> sampling.Sampler:
    ratio = sampling.TraceIdRatioBased(config.sampler_arg)
    return {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": ratio,
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBased(ratio),
    }[config.sampler]


def otlp_span_exporter(target: OtlpTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=target.endpoint, insecure=target.insecure, timeout=target.timeout_s,
                                headers=dict(target.headers))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

    return HttpSpanExporter(endpoint=target.endpoint, timeout=target.timeout_s, headers=dict(target.headers))


def otlp_metric_exporter(target: OtlpTarget):
    # Cumulative: what Prometheus (behind the Collector) needs; the SDK default could be overridden
    # by an environment variable we do not read.
    from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter

    temporality = {k: AggregationTemporality.CUMULATIVE for k in (Counter, Histogram, ObservableCounter)}
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=target.endpoint, insecure=target.insecure, timeout=target.timeout_s,
                                  headers=dict(target.headers), preferred_temporality=temporality)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

    return HttpMetricExporter(endpoint=target.endpoint, timeout=target.timeout_s, headers=dict(target.headers),
                              preferred_temporality=temporality)


def bounded_processor(exporter: SpanExporter, config: TelemetryConfig) -> tuple[SpanProcessor, ExportStats]:
    stats = ExportStats(config.bsp_max_queue_size)
    batch = BatchSpanProcessor(
        CountingSpanExporter(exporter, stats),
        max_queue_size=config.bsp_max_queue_size,
        schedule_delay_millis=config.bsp_schedule_delay_ms,
        max_export_batch_size=min(config.bsp_max_export_batch_size, config.bsp_max_queue_size),
        export_timeout_millis=config.bsp_export_timeout_ms,
    )
    return BoundedSpanProcessor(batch, stats), stats


def start_prometheus(config: TelemetryConfig) -> tuple[MetricReader, Callable[[], None], int]:
    """A scrape endpoint on its own registry (not prometheus_client's global one) -> (reader, stop, port)."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:  # the optional extra is not installed
        raise RuntimeError("the Prometheus endpoint needs `pip install moespec[prometheus]`") from e
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    server, thread = start_http_server(config.prometheus_port, addr=config.prometheus_host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return reader, stop, server.server_port


def build_telemetry_from_config(
    config: TelemetryConfig,
    info: ModelInfo,
    *,
    extra_span_processors: Sequence[SpanProcessor] = (),
    extra_metric_readers: Sequence[MetricReader] = (),
    seed: int | None = None,
) -> NoTelemetry | OtelTelemetry:
    """`extra_*` let tests attach in-memory exporters/readers next to the configured ones."""
    if not config.enabled and not extra_span_processors and not extra_metric_readers:
        return NoTelemetry()
    resource = build_resource(config, info)
    stats: list[ExportStats] = []
    closers: list[Callable[[], None]] = []

    tracer_provider = None
    if config.traces_exporters or extra_span_processors:
        tracer_provider = TracerProvider(sampler=build_sampler(config), resource=resource, shutdown_on_exit=False)
        # sys.stdout as it is now (the SDK's default argument froze the one from import time).
        exporters = {"otlp": lambda: otlp_span_exporter(config.traces_otlp),
                     "console": lambda: ConsoleSpanExporter(out=sys.stdout)}
        for name in config.traces_exporters:
            processor, processor_stats = bounded_processor(exporters[name](), config)
            tracer_provider.add_span_processor(processor)
            stats.append(processor_stats)
        for processor in extra_span_processors:
            tracer_provider.add_span_processor(processor)

    meter_provider = None
    prometheus_port = None
    batched = deferred = False
    if config.metrics_exporters or extra_metric_readers:
        readers: list[MetricReader] = list(extra_metric_readers)
        interval = dict(export_interval_millis=config.metric_export_interval_ms,
                        export_timeout_millis=config.metric_export_timeout_ms)
        for name in config.metrics_exporters:
            if name == "otlp":
                readers.append(PeriodicExportingMetricReader(otlp_metric_exporter(config.metrics_otlp), **interval))
            elif name == "console":
                readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout), **interval))
            elif name == "prometheus":
                reader, stop, prometheus_port = start_prometheus(config)
                readers.append(reader)
                closers.append(stop)
                logger.info("Prometheus metrics on http://%s:%d/metrics", config.prometheus_host, prometheus_port)
        # No exemplars: the SDK's default offers every measurement to a reservoir (a quarter of the
        # metrics' cost per request here), and the request's trace already links its steps.
        # A request's per-step histogram values go to the SDK in one call per series (otel.aggregate),
        # where this SDK aggregates such a batch exactly as it would each value; and those calls wait
        # for the next collection (otel.deferred), where this SDK lets them.
        batched = batching_works()
        deferred = batched and deferral_works()
        meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False,
                                       exemplar_filter=AlwaysOffExemplarFilter(),
                                       views=[histogram_view(INSTRUMENTATION_SCOPE)] if batched else [])

    telemetry = OtelTelemetry(info, tracer_provider, meter_provider, verify_span_ratio=config.verify_span_ratio,
                              export_stats=stats, on_shutdown=closers, seed=seed, batched_histograms=batched,
                              deferred_metrics=deferred)
    telemetry.prometheus_port = prometheus_port
    return telemetry
