"""gRPC plumbing shared by both clients: channels, the method table, status -> exception."""

from __future__ import annotations

from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import KVStoreError, from_status
from kvstore.security import ClientSecurity
from kvstore.wire import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name

# name -> (request serializer, response deserializer). None leaves bytes as they are: Put requests are
# sent already serialized and Get responses received serialized, so page bytes skip protobuf's extra copy
# (kvstore.wire.streams.put_requests / GetAssembler); the wire format is the proto's all the same.
_UNARY = {
    "Lookup": pb.LookupResponse,
    "Delete": pb.DeleteResponse,
    "Pin": pb.PinResponse,
    "Unpin": pb.UnpinResponse,
    "Prefetch": pb.PrefetchResponse,
    "Stats": pb.StatsResponse,
    "Report": pb.ReportResponse,
    "Retain": pb.RetainResponse,
    "Replicate": pb.ReplicateResponse,
}


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def bind_methods(channel: grpc.Channel | grpc.aio.Channel) -> dict[str, Any]:
    """Callables for every KVStore method on a channel (blocking or asyncio alike)."""

    def path(name: str) -> str:
        return f"/{SERVICE}/{name}"

    methods: dict[str, Any] = {
        name: channel.unary_unary(path(name), request_serializer=_serialize, response_deserializer=resp.FromString)
        for name, resp in _UNARY.items()
    }
    methods["Put"] = channel.stream_unary(
        path("Put"), request_serializer=None, response_deserializer=pb.PutResponse.FromString
    )
    methods["Get"] = channel.unary_stream(
        path("Get"), request_serializer=pb.GetRequest.SerializeToString, response_deserializer=None
    )
    return methods


def open_channel(target: str, security: ClientSecurity, *, aio: bool) -> grpc.Channel | grpc.aio.Channel:
    options = CHANNEL_OPTIONS + security.channel_options()
    creds = security.channel_credentials()
    if aio:
        if creds is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, creds, options=options)
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


def rpc_error(err: grpc.RpcError) -> KVStoreError:
    """The kvstore exception a failed call stands for (the server's class and message)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    return from_status(code.name, err.details() or "")
