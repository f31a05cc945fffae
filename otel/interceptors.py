"""The gRPC server interceptor that opens the server span and continues a client's `traceparent`.

opentelemetry-instrumentation-grpc's aio interceptor, bound to our own TracerProvider (not the
global one). It extracts the W3C trace context from the call metadata with the globally configured
propagator (tracecontext + baggage unless OTEL_PROPAGATORS says otherwise). Health checks and
reflection are left out: a load balancer probing every few seconds would drown the traces.
"""

from __future__ import annotations

from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.trace import TracerProvider

UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")


def server_interceptors(tracer_provider: TracerProvider | None) -> list:
    """Interceptors for `grpc.aio.server(interceptors=...)`; [] when tracing is off."""
    if tracer_provider is None:
        return []
    untraced = filters.any_of(*(filters.service_prefix(s) for s in UNTRACED_SERVICES))
    return [aio_server_interceptor(tracer_provider=tracer_provider, filter_=filters.negate(untraced))]
