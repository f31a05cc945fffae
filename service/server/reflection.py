"""gRPC server reflection, versions v1 and v1alpha, answering from descriptors with source info.

Why not grpcio-reflection's servicer: it speaks v1alpha only (clients that speak only v1 get
UNIMPLEMENTED), it builds its answers with `CopyToProto`, which drops the source info (so the .proto
comments, where the API contract is written, never reach a client), and its symbol lookup does not
find methods (`moespec.v1.Inference.Generate`).

Contract:
- `enable(server, service_names)` adds `grpc.reflection.v1.ServerReflection` and
  `grpc.reflection.v1alpha.ServerReflection` to a grpc.aio server; `list_services` answers the given
  names plus both reflection services.
- Files come from the descriptor set scripts/gen_proto.py writes (service/proto_gen/descriptors.binpb,
  compiled with --include_source_info: moespec's API and the reflection v1 interface), and from the
  runtime descriptors of the other services served (grpc.health.v1, reflection v1alpha; no comments).
- Symbols resolve to their file: packages' messages, fields, oneofs, enums, enum values (both in
  the enum's enclosing scope, protobuf's rule, and under the enum's own name), services, methods
  and extensions. A file answer carries the file and its transitive dependencies.
- The two versions' messages are field for field the same (proto/grpc/reflection/v1/reflection.proto;
  tests check the descriptors agree), so both are served with grpcio-reflection's v1alpha message
  classes: a v1 request parses as a v1alpha one and a v1alpha answer is a valid v1 answer on the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from importlib import resources

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as wire

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
METHOD = "ServerReflectionInfo"
DESCRIPTOR_SET = ("service.proto_gen", "descriptors.binpb")


class DescriptorIndex:
    """Serialized FileDescriptorProtos by file name, and the file declaring each symbol."""

    def __init__(self, files: Iterable[descriptor_pb2.FileDescriptorProto]):
        self._files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        self._symbols: dict[str, str] = {}
        self._extensions: dict[tuple[str, int], str] = {}
        for f in files:
            if f.name in self._files:  # the first source wins: the set (with comments) comes first
                continue
            self._files[f.name] = f
            self._index_file(f)

    def file_names(self) -> list[str]:
        return sorted(self._files)

    def symbol_file(self, symbol: str) -> str | None:
        return self._symbols.get(symbol.lstrip("."))

    def extension_file(self, containing_type: str, number: int) -> str | None:
        return self._extensions.get((containing_type.lstrip("."), number))

    def extension_numbers(self, containing_type: str) -> list[int]:
        name = containing_type.lstrip(".")
        return sorted(n for t, n in self._extensions if t == name)

    def is_message(self, name: str) -> bool:
        file = self.symbol_file(name)
        return file is not None and any(m == name.lstrip(".") for m in self._messages(self._files[file]))

    def with_dependencies(self, name: str) -> list[bytes] | None:
        """The file and every file it imports, transitively, serialized; None if unknown."""
        if name not in self._files:
            return None
        out, seen, todo = [], set(), [name]
        while todo:
            current = todo.pop()
            if current in seen or current not in self._files:
                continue
            seen.add(current)
            proto = self._files[current]
            out.append(proto.SerializeToString())
            todo.extend(proto.dependency)
        return out

    # ------------------------------------------------------------------ indexing
    def _index_file(self, f: descriptor_pb2.FileDescriptorProto) -> None:
        scope = f.package
        for message in f.message_type:
            self._index_message(f.name, _join(scope, message.name), message)
        for enum in f.enum_type:
            self._index_enum(f.name, scope, enum)
        for service in f.service:
            service_name = _join(scope, service.name)
            self._symbols[service_name] = f.name
            for method in service.method:
                self._symbols[_join(service_name, method.name)] = f.name
        for extension in f.extension:
            self._index_extension(f.name, scope, extension)

    def _index_message(self, file: str, name: str, message: descriptor_pb2.DescriptorProto) -> None:
        self._symbols[name] = file
        for field in message.field:
            self._symbols[_join(name, field.name)] = file
        for oneof in message.oneof_decl:
            self._symbols[_join(name, oneof.name)] = file
        for nested in message.nested_type:
            self._index_message(file, _join(name, nested.name), nested)
        for enum in message.enum_type:
            self._index_enum(file, name, enum)
        for extension in message.extension:
            self._index_extension(file, name, extension)

    def _index_enum(self, file: str, scope: str, enum: descriptor_pb2.EnumDescriptorProto) -> None:
        enum_name = _join(scope, enum.name)
        self._symbols[enum_name] = file
        for value in enum.value:
            self._symbols.setdefault(_join(scope, value.name), file)  # protobuf's scope for enum values
            self._symbols[_join(enum_name, value.name)] = file  # the name people write

    def _index_extension(self, file: str, scope: str, extension: descriptor_pb2.FieldDescriptorProto) -> None:
        self._symbols[_join(scope, extension.name)] = file
        self._extensions[(extension.extendee.lstrip("."), extension.number)] = file

    def _messages(self, f: descriptor_pb2.FileDescriptorProto) -> Iterable[str]:
        def walk(scope: str, messages) -> Iterable[str]:
            for m in messages:
                name = _join(scope, m.name)
                yield name
                yield from walk(name, m.nested_type)

        return walk(f.package, f.message_type)


def _join(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


def shipped_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """The descriptor set with source info (package data), then the runtime descriptors of the other
    services served (health, reflection v1alpha), which the set does not hold."""
    data = resources.files(DESCRIPTOR_SET[0]).joinpath(DESCRIPTOR_SET[1]).read_bytes()
    files = list(descriptor_pb2.FileDescriptorSet.FromString(data).file)
    for runtime in (health_pb2.DESCRIPTOR, wire.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        runtime.CopyToProto(proto)
        files.append(proto)
    return files


class ReflectionService:
    """One ServerReflectionInfo implementation, mounted under both reflection service names."""

    def __init__(self, index: DescriptorIndex, service_names: Iterable[str]):
        self._index = index
        self._services = tuple(sorted({*service_names, V1_SERVICE, V1ALPHA_SERVICE}))

    async def info(self, requests: AsyncIterator[wire.ServerReflectionRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[wire.ServerReflectionResponse]:
        async for request in requests:
            yield self.answer(request)

    def answer(self, request: wire.ServerReflectionRequest) -> wire.ServerReflectionResponse:
        kind = request.WhichOneof("message_request")
        if kind == "file_by_filename":
            return self._files(request, request.file_by_filename, f"no file {request.file_by_filename!r}")
        if kind == "file_containing_symbol":
            symbol = request.file_containing_symbol
            return self._files(request, self._index.symbol_file(symbol), f"symbol not found: {symbol!r}")
        if kind == "file_containing_extension":
            ext = request.file_containing_extension
            return self._files(request, self._index.extension_file(ext.containing_type, ext.extension_number),
                               f"no extension {ext.extension_number} of {ext.containing_type!r}")
        if kind == "all_extension_numbers_of_type":
            name = request.all_extension_numbers_of_type
            if not self._index.is_message(name):
                return _error(request, grpc.StatusCode.NOT_FOUND, f"no message type {name!r}")
            return wire.ServerReflectionResponse(
                valid_host=request.host, original_request=request,
                all_extension_numbers_response=wire.ExtensionNumberResponse(
                    base_type_name=name.lstrip("."), extension_number=self._index.extension_numbers(name)))
        if kind == "list_services":
            return wire.ServerReflectionResponse(
                valid_host=request.host, original_request=request,
                list_services_response=wire.ListServiceResponse(
                    service=[wire.ServiceResponse(name=n) for n in self._services]))
        return _error(request, grpc.StatusCode.INVALID_ARGUMENT, "the request sets no message_request field")

    def _files(self, request: wire.ServerReflectionRequest, name: str | None,
               not_found: str) -> wire.ServerReflectionResponse:
        files = self._index.with_dependencies(name) if name else None
        if files is None:
            return _error(request, grpc.StatusCode.NOT_FOUND, not_found)
        return wire.ServerReflectionResponse(
            valid_host=request.host, original_request=request,
            file_descriptor_response=wire.FileDescriptorResponse(file_descriptor_proto=files))


def _error(request: wire.ServerReflectionRequest, code: grpc.StatusCode,
           message: str) -> wire.ServerReflectionResponse:
    return wire.ServerReflectionResponse(
        valid_host=request.host, original_request=request,
        error_response=wire.ErrorResponse(error_code=code.value[0], error_message=message))


def enable(server: grpc.aio.Server, service_names: Iterable[str],
           files: Iterable[descriptor_pb2.FileDescriptorProto] | None = None) -> ReflectionService:
    """Serve reflection v1 and v1alpha on `server` for `service_names` (plus reflection itself)."""
    service = ReflectionService(DescriptorIndex(shipped_files() if files is None else files), service_names)
    handler = grpc.stream_stream_rpc_method_handler(
        service.info,
        request_deserializer=wire.ServerReflectionRequest.FromString,
        response_serializer=wire.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {METHOD: handler}) for name in (V1_SERVICE, V1ALPHA_SERVICE)
    ))
    return service
