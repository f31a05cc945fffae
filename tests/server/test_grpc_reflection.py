"""Server reflection as clients in other languages use it: v1 (a raw v1 client whose messages are built
here from gRPC's published interface) and v1alpha (grpcio-reflection's own client), over a real
channel to a real server. Method and enum symbols resolve, and the .proto comments arrive."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_tools import protoc

import service
from service.server.reflection import shipped_files

# FileDescriptorProto field numbers (descriptor.proto), for source-info paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_ENUM, SERVICE_METHOD = 2, 4, 2


def v1_messages():
    """grpc.reflection.v1's request/response classes: gRPC publishes v1 as v1alpha's messages under
    the package grpc.reflection.v1, so they are built that way, in a private pool."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "test/grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
        method.output_type = method.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest")),
            get(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")))


V1Request, V1Response = v1_messages()


@pytest.fixture(scope="module")
def v1_call(server):
    with grpc.insecure_channel(server.address) as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=V1Request.SerializeToString,
                                     response_deserializer=V1Response.FromString)

        def ask(**request):
            (answer,) = list(info(iter([V1Request(**request)]), timeout=10))
            return answer

        yield ask


def file_of(answer, name: str) -> descriptor_pb2.FileDescriptorProto:
    serialized = answer.file_descriptor_response.file_descriptor_proto
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in serialized]
    return next(f for f in files if f.name == name)


def comment(f: descriptor_pb2.FileDescriptorProto, path: list[int]) -> str:
    return next(loc.leading_comments + loc.trailing_comments for loc in f.source_code_info.location
                if list(loc.path) == path)


def test_v1_resolves_a_method_symbol_and_carries_its_comment(v1_call):
    answer = v1_call(file_containing_symbol="moespec.v1.Inference.Generate")
    assert answer.WhichOneof("message_response") == "file_descriptor_response", answer
    f = file_of(answer, "moespec/v1/moespec.proto")
    s = [i for i, svc in enumerate(f.service) if svc.name == "Inference"][0]
    m = [i for i, method in enumerate(f.service[s].method) if method.name == "Generate"][0]
    text = comment(f, [FILE_SERVICE, s, SERVICE_METHOD, m])
    assert "INVALID_ARGUMENT" in text and "UNAVAILABLE" in text


def test_v1_carries_the_request_contract_in_field_comments(v1_call):
    f = file_of(v1_call(file_containing_symbol="moespec.v1.GenerateRequest"), "moespec/v1/moespec.proto")
    msg = [i for i, m in enumerate(f.message_type) if m.name == "GenerateRequest"][0]
    fields = {fd.name: i for i, fd in enumerate(f.message_type[msg].field)}
    assert "exactly one of prompt and prompt_token_ids" in comment(f, [FILE_MESSAGE, msg, MESSAGE_FIELD,
                                                                      fields["prompt"]])
    assert "max_context - prompt_tokens" in comment(f, [FILE_MESSAGE, msg, MESSAGE_FIELD, fields["max_new_tokens"]])
    file_comment = comment(f, [12])  # the comment above `syntax`: conventions, health names, shutdown
    assert "authorization: Bearer <token>" in file_comment and "moespec.v1.PolicyAdmin" in file_comment


@pytest.mark.parametrize("symbol", ["moespec.v1.DraftPolicy.Drafter", "moespec.v1.DraftPolicy.Drafter.NGRAM",
                                    "moespec.v1.DraftPolicy.NGRAM", "moespec.v1.PolicyAdmin",
                                    "moespec.v1.GenerateResponse.finish_reason", "grpc.health.v1.Health.Check",
                                    "grpc.reflection.v1.ServerReflection.ServerReflectionInfo"])
def test_v1_resolves_services_enums_values_and_fields(v1_call, symbol):
    answer = v1_call(file_containing_symbol=symbol)
    assert answer.WhichOneof("message_response") == "file_descriptor_response", answer


def test_v1_says_not_found_for_an_unknown_symbol(v1_call):
    answer = v1_call(file_containing_symbol="moespec.v1.Inference.Nope")
    assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "moespec.v1.Inference.Nope" in answer.error_response.error_message


def test_v1_lists_every_service_served(v1_call):
    names = {s.name for s in v1_call(list_services="").list_services_response.service}
    assert names == {"moespec.v1.Inference", "moespec.v1.PolicyAdmin", "grpc.health.v1.Health",
                     "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


def test_v1alpha_client_resolves_methods_with_grpcio_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindMethodByName("moespec.v1.Inference.GenerateStream")
        assert method.output_type.full_name == "moespec.v1.GenerateChunk" and method.server_streaming
        assert pool.FindEnumTypeByName("moespec.v1.DraftPolicy.Drafter").values_by_name["NGRAM"].number == 1


def test_the_v1_interface_shipped_matches_v1alpha_field_for_field():
    """Why one implementation (v1alpha's message classes) serves both versions."""
    files = {f.name: f for f in shipped_files()}
    ours, theirs = files["grpc/reflection/v1/reflection.proto"], files["grpc_reflection/v1alpha/reflection.proto"]

    def shape(f):
        return {m.name: sorted((fd.name, fd.number, fd.type, fd.label, fd.type_name.rsplit(".", 1)[-1],
                                fd.HasField("oneof_index")) for fd in m.field) for m in f.message_type}

    assert ours.package == "grpc.reflection.v1" and shape(ours) == shape(theirs)

    def methods(f):
        return [(m.name, m.input_type.rsplit(".", 1)[-1], m.output_type.rsplit(".", 1)[-1], m.client_streaming,
                 m.server_streaming) for m in f.service[0].method]

    assert methods(ours) == methods(theirs)


def test_the_shipped_descriptor_set_is_what_the_protos_compile_to(tmp_path):
    """scripts/gen_proto.py was rerun after the last .proto edit (and the Python stubs agree)."""
    from service.proto_gen.moespec.v1 import moespec_pb2

    root = Path(service.__file__).resolve().parent.parent / "proto"  # the repository's proto/
    out = tmp_path / "set.binpb"
    names = ["moespec/v1/moespec.proto", "grpc/reflection/v1/reflection.proto"]
    assert protoc.main(["protoc", f"-I{root}", "--include_source_info", "--include_imports",
                        f"--descriptor_set_out={out}", *names]) == 0
    fresh = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file}
    shipped = {f.name: f for f in shipped_files() if f.name in fresh}
    assert shipped == fresh
    # The stubs embed what protoc emits for them: the same file less its source info and json names.
    stub = descriptor_pb2.FileDescriptorProto.FromString(moespec_pb2.DESCRIPTOR.serialized_pb)
    bare = descriptor_pb2.FileDescriptorProto()
    bare.CopyFrom(shipped["moespec/v1/moespec.proto"])
    bare.ClearField("source_code_info")
    for message in bare.message_type:
        for field in message.field:
            field.ClearField("json_name")
    assert stub == bare


def test_every_comment_in_the_api_is_a_leading_one():
    """Some reflection clients (grpcurl among them) print leading comments only, so the contract is
    written above each declaration, never after it."""
    f = next(f for f in shipped_files() if f.name == "moespec/v1/moespec.proto")
    trailing = [(list(loc.path), loc.trailing_comments) for loc in f.source_code_info.location
                if loc.trailing_comments]
    assert trailing == []
