"""Operations: health, reflection, TLS, and graceful shutdown of a real `moespec serve` process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service.server.client import MoespecClient
from service.server.server import SERVICE_NAMES, ServerConfig
from service.types import FinishReason, GenerationRequest, SamplingParams
from tests.conftest import ServerThread


@pytest.mark.parametrize("service", ["", *SERVICE_NAMES])
def test_health_reports_serving_for_the_server_and_each_service(client, service):
    assert client.health(service) == "SERVING"


def test_reflection_lists_the_services_and_resolves_their_methods(server):
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"moespec.v1.Inference", "moespec.v1.PolicyAdmin", "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(db)
        inference = pool.FindServiceByName("moespec.v1.Inference")
        assert {m.name for m in inference.methods} == {"Generate", "GenerateStream", "GetModelInfo"}
        spec = pool.FindMessageTypeByName("moespec.v1.SpecStats")
        assert "unique_experts_max" in spec.fields_by_name


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_server_answers_a_client_that_trusts_its_cert_and_refuses_plaintext(backend, tls_files):
    cert, key = tls_files
    s = ServerThread(backend, ServerConfig(port=0, tls_cert=cert.read_bytes(), tls_key=key.read_bytes()))
    try:
        with MoespecClient(s.address, tls_ca=cert) as c:
            assert c.model_info().num_experts > 0
        with MoespecClient(s.address) as plain, pytest.raises(grpc.RpcError) as e:
            plain.model_info(timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.stop()


DRAIN_TOKENS = 200  # seconds of greedy work on this CPU: the drain really waits for it


def test_sigterm_marks_not_serving_and_lets_the_in_flight_stream_finish(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--threads", "1", "--grace", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("moespec serving on "), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[-1]
        with MoespecClient(address) as c, grpc.insecure_channel(address) as channel:
            c.wait_ready(timeout=30)
            not_serving = threading.Event()
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            watcher = threading.Thread(target=lambda: _until_not_serving(watch, not_serving))
            watcher.start()
            request = GenerationRequest(prompt="def add(a, b):", max_new_tokens=DRAIN_TOKENS,
                                        sampling=SamplingParams(temperature=0.0))
            stream = c.stream(request, timeout=120)
            next(stream)  # in flight
            proc.send_signal(signal.SIGTERM)
            # Chunks that arrive after the server has said NOT_SERVING prove the drain happened
            # while this request was in flight (checked, not assumed from its length).
            tokens_after_not_serving = 0
            for chunk in stream:
                if not_serving.is_set():
                    tokens_after_not_serving += len(chunk.token_ids)
                final = chunk.reply
            watcher.join(30)
            watch.cancel()
        assert not_serving.is_set()
        assert tokens_after_not_serving > 0, "the request finished before the drain began"
        assert final.finish_reason is FinishReason.LENGTH and final.completion_tokens == DRAIN_TOKENS
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _until_not_serving(watch, not_serving: threading.Event) -> None:
    for reply in watch:
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            not_serving.set()
            return
