"""gRPC server reflection, v1 beside v1alpha: current clients (grpcurl, grpcui, Postman,
grpc-java and grpc-go's) ask for ``grpc.reflection.v1.ServerReflection`` first, and
``grpcio-reflection`` ships only v1alpha.

The two protocols are the same messages under another package name (identical field numbers,
so identical bytes on the wire). So v1 is served by the v1alpha servicer itself, on the v1
method path, and the v1 file descriptor (v1alpha's, renamed) joins the default pool so a client
that asks reflection about v1 itself finds it too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_METHOD = "ServerReflectionInfo"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor with every name moved to the v1 package."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = "." + proto.package
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = "." + V1_PACKAGE + f.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = "." + V1_PACKAGE + method.input_type[len(old) :]
            method.output_type = "." + V1_PACKAGE + method.output_type[len(old) :]
    return proto


def v1_file_descriptor():
    """The v1 reflection file in the default pool (added once)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.Add(_v1_file())
        return pool.FindFileByName(_V1_FILE)


def v1_message_classes():
    """(ServerReflectionRequest, ServerReflectionResponse) of the v1 package, for clients."""
    file = v1_file_descriptor()
    return tuple(
        message_factory.GetMessageClass(file.message_types_by_name[name])
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    )


def enable_reflection(service_names, server) -> None:
    """Reflection v1alpha and v1 on ``server`` (sync or asyncio) for ``service_names`` (both
    reflection services are added to the list)."""
    v1_file_descriptor()
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    if isinstance(server, grpc.aio.Server):
        servicer = reflection.aio.ReflectionServicer(names)
    else:
        servicer = reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (reflection.SERVICE_NAME, V1_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {V1_METHOD: handler}),)
        )
