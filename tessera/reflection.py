"""gRPC server reflection under both of its names: grpc.reflection.v1, which grpcurl, Postman
and current gRPC tools ask first, and grpc.reflection.v1alpha, which older clients (and
grpcio-reflection's own ProtoReflectionDescriptorDatabase) speak.

grpcio-reflection (1.85) serves v1alpha only. v1 is the same protocol: the same messages with
the same field numbers under another package, so one servicer answers both, and v1's file
descriptor (v1alpha's, renamed) joins the default pool so that reflection can describe v1 too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _renamed_types(messages: Iterable[descriptor_pb2.DescriptorProto], old: str, new: str) -> None:
    for message in messages:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old):]
        _renamed_types(message.nested_type, old, new)


def _add_v1_descriptor() -> None:
    """grpc/reflection/v1/reflection.proto in the default pool (once), built from v1alpha's."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{_V1_PACKAGE}."
    proto.name, proto.package = _V1_FILE, _V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java/go package names
    _renamed_types(proto.message_type, old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    pool.Add(proto)


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Reflection for `service_names` (and itself, under both names) on `server`, as v1 and v1alpha."""
    _add_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = (reflection.aio.ReflectionServicer(names) if isinstance(server, grpc.aio.Server)
                else reflection.ReflectionServicer(names))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    # v1 on the wire is v1alpha's bytes: v1alpha's classes read and write it.
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME,
                                                                          {"ServerReflectionInfo": v1}),))
