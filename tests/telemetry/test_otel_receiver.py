"""The reusable OTLP/gRPC receiver: a real SDK exporter talks to it; values come back as plain Python."""

from __future__ import annotations

import threading

from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

from otel.receiver import OtlpTraceReceiver, any_value


def test_spans_from_a_real_exporter_arrive_as_dicts():
    with OtlpTraceReceiver() as receiver:
        provider = TracerProvider(resource=Resource({"service.name": "t"}), shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)))
        tracer = provider.get_tracer("scope-x")
        attributes = {"s": "v", "b": True, "i": 7, "f": 0.5, "ints": (1, 2, 3), "floats": (0.5, 1.5),
                      "strs": ("a", "b")}
        with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent, \
                tracer.start_as_current_span("child", attributes=attributes) as child:
            child.set_status(StatusCode.ERROR, "bad")
        spans = receiver.wait_for(lambda s: len(s) == 2)
        provider.shutdown()
    by_name = {s["name"]: s for s in spans}
    p, c = by_name["parent"], by_name["child"]
    assert c["attributes"] == {"s": "v", "b": True, "i": 7, "f": 0.5, "ints": (1, 2, 3), "floats": (0.5, 1.5),
                               "strs": ("a", "b")}
    assert c["parent_span_id"] == p["span_id"] and p["parent_span_id"] == ""
    assert c["trace_id"] == p["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    assert c["span_id"] == format(child.get_span_context().span_id, "016x")
    assert p["kind"] == "SERVER" and c["kind"] == "INTERNAL"
    assert c["status_code"] == "ERROR" and c["status_message"] == "bad" and p["status_code"] == "UNSET"
    assert c["resource"]["service.name"] == "t" and c["scope"] == "scope-x"
    assert c["start_ns"] <= c["end_ns"]


def test_callback_receives_each_batch_instead_of_keeping_it():
    batches, got = [], threading.Event()

    def on_spans(spans):
        batches.append(spans)
        got.set()

    with OtlpTraceReceiver(on_spans=on_spans) as receiver:
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)))
        provider.get_tracer("t").start_span("one").end()
        assert got.wait(10)
        provider.shutdown()
        assert receiver.spans == []
    assert [s["name"] for s in batches[0]] == ["one"]


def test_metrics_sent_to_the_same_endpoint_are_accepted():
    with OtlpTraceReceiver() as receiver:
        exporter = OTLPMetricExporter(endpoint=receiver.endpoint, insecure=True)
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        provider.get_meter("m").create_counter("c").add(1)
        assert exporter.export(reader.get_metrics_data()).name == "SUCCESS"
        assert receiver.metric_exports == 1
        provider.shutdown()


def test_any_value_converts_every_kind():
    assert any_value(AnyValue()) is None
    assert any_value(AnyValue(bytes_value=b"\x01")) == b"\x01"
    nested = AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="k", value=AnyValue(int_value=1))]))
    assert any_value(nested) == {"k": 1}
    assert any_value(AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="x")]))) == ("x",)


def test_port_zero_binds_a_free_port_and_stop_releases_it():
    receiver = OtlpTraceReceiver(port=0)
    port = receiver.start()
    assert port > 0 and receiver.endpoint == f"http://127.0.0.1:{port}"
    receiver.stop()
    again = OtlpTraceReceiver(port=port)
    assert again.start() == port
    again.stop()
