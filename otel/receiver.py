"""A minimal OTLP/gRPC trace receiver: the tests' collector, and the tuner's span intake.

`OtlpTraceReceiver(host, port, on_spans=callback)` implements the TraceService of opentelemetry-proto
on a plain grpc server (its own thread pool; usable from sync and asyncio code alike). Each Export
call is converted to plain dicts (`span_to_dict`) and handed to `on_spans(list_of_dicts)` on a gRPC
worker thread; without a callback the spans are kept in `.spans`. Port 0 picks a free port;
`endpoint` is the URL to give an OTLP exporter (OTEL_EXPORTER_OTLP_ENDPOINT). Metrics sent to the
same endpoint are accepted and discarded (counted in `metric_exports`), so a service pointed here
with its generic OTLP endpoint does not log export errors.

Who may export: with `bearer_token`, every Export (traces and metrics) must carry the metadata
`authorization: Bearer <token>` (what an OTLP exporter's `headers` / OTEL_EXPORTER_OTLP_HEADERS send),
compared in constant time; anything else is answered UNAUTHENTICATED, counted in
`rejected_exports`, and never reaches `on_spans`. With `tls_cert` and `tls_key` (PEM bytes) the
receiver serves TLS only. Without either, anyone who can reach the port is believed: bind loopback.

A span dict: trace_id / span_id / parent_span_id (hex, "" for a root), name, kind ("SERVER",
"INTERNAL", ...), start_ns, end_ns, status_code ("UNSET" | "OK" | "ERROR"), status_message,
attributes {key: str | bool | int | float | tuple}, resource {key: value}, scope (name), links
(a list of {trace_id, span_id} in hex: the spans a `verify_batch` span served).
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

SpanDict = dict
OnSpans = Callable[[list[SpanDict]], None]


def any_value(value: AnyValue):
    """OTLP AnyValue -> Python value; arrays become tuples (as the SDK takes them)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return attributes_dict(value.kvlist_value.values)
    return getattr(value, which)


def attributes_dict(pairs: Iterable[KeyValue]) -> dict:
    return {kv.key: any_value(kv.value) for kv in pairs}


def span_to_dict(span: trace_pb2.Span, resource: dict | None = None, scope: str = "") -> SpanDict:
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "name": span.name,
        "kind": trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "status_code": trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
        "status_message": span.status.message,
        "attributes": attributes_dict(span.attributes),
        "resource": resource or {},
        "scope": scope,
        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links],
    }


def spans_from_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanDict]:
    out = []
    for resource_spans in request.resource_spans:
        resource = attributes_dict(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            out.extend(span_to_dict(s, resource, scope_spans.scope.name) for s in scope_spans.spans)
    return out


def bearer_token(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` metadata entry, if any."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, owner: OtlpTraceReceiver):
        self.owner = owner

    def Export(self, request, context):  # noqa: N802 (the generated servicer's method name)
        self.owner._authenticate(context)
        self.owner._deliver(spans_from_request(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsSink(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, owner: OtlpTraceReceiver):
        self.owner = owner

    def Export(self, request, context):  # noqa: N802
        self.owner._authenticate(context)
        with self.owner._cond:
            self.owner.metric_exports += 1
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpTraceReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, on_spans: OnSpans | None = None,
                 max_workers: int = 4, bearer_token: str | None = None, tls_cert: bytes | None = None,
                 tls_key: bytes | None = None):
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together")
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.on_spans = on_spans
        self.max_workers = max_workers
        self._token = bearer_token.encode() if bearer_token else None
        self._tls = (tls_key, tls_cert) if tls_cert else None
        self.spans: list[SpanDict] = []  # kept only when there is no callback
        self.metric_exports = 0
        self.rejected_exports = 0  # Export calls refused for a missing or wrong bearer token
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self.address}"

    def start(self) -> int:
        """Bind and serve; returns the bound port."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers,
                                                        thread_name_prefix="otlp-receiver"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsSink(self), server)
        target = f"{self.host}:{self.requested_port}"
        if self._tls:
            self.port = server.add_secure_port(target, grpc.ssl_server_credentials([self._tls]))
        else:
            self.port = server.add_insecure_port(target)
        if not self.port:
            raise OSError(f"cannot listen on {self.host}:{self.requested_port}")
        server.start()
        self._server = server
        return self.port

    def stop(self, grace: float | None = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self) -> OtlpTraceReceiver:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for(self, predicate: Callable[[list[SpanDict]], bool], timeout: float = 10.0) -> list[SpanDict]:
        """Block until predicate(spans received so far) holds (kept spans only); returns them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"received {len(self.spans)} spans; condition not met in {timeout}s")
                self._cond.wait(left)
            return list(self.spans)

    def _authenticate(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        presented = bearer_token(context.invocation_metadata())
        # compare_digest on bytes: constant time in the token's content.
        if presented is not None and hmac.compare_digest(presented.encode(), self._token):
            return
        with self._cond:
            self.rejected_exports += 1
        reason = "missing" if presented is None else "wrong"
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"{reason} bearer token: send 'authorization: Bearer <token>' (the exporter's headers)")

    def _deliver(self, spans: list[SpanDict]) -> None:
        if self.on_spans is not None:
            self.on_spans(spans)
            return
        with self._cond:
            self.spans.extend(spans)
            self._cond.notify_all()


def main(argv: list[str] | None = None) -> int:
    """`python -m otel.receiver [--host H] [--port P]`: a stand-alone receiver that counts spans.

    Prints "otlp receiver on HOST:PORT" once listening (the bound port when --port 0), then runs until
    stdin closes or SIGTERM, and prints "received N spans". Used by service.bench.telemetry as the live collector.
    """
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m otel.receiver", description=main.__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    count = [0]
    lock = threading.Lock()

    def on_spans(spans: list[SpanDict]) -> None:
        with lock:
            count[0] += len(spans)

    receiver = OtlpTraceReceiver(args.host, args.port, on_spans=on_spans)
    receiver.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print(f"otlp receiver on {receiver.address}", flush=True)
    stop.wait()
    receiver.stop(grace=0.5)
    print(f"received {count[0]} spans", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
