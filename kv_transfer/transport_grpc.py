"""gRPC transport: one client-streaming KvTransfer.PushFrames call per KVStream.

Frames of a stream go through a bounded queue into the call's request iterator, so a slow
receiver pushes back on the sender thread instead of buffering a whole request in memory.
The receiver keeps consuming after a bad frame and reports every rejection in the PushAck.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor

import grpc

from grpc_plumbing.auth import TOKEN_KEY, require_token_off_loopback, token_matches
from grpc_plumbing.server import EXCLUSIVE_PORT, bind, message_options
from grpc_plumbing.tls import ClusterTls
from kv_transfer.errors import FrameError, ReceiverFault
from kv_transfer.interfaces import Channel, Link, ReceiverServer
from protos import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger("pdserve.kv")

MAX_QUEUED_FRAMES = 8  # per stream: ~28 MiB in flight at most
MAX_REPORTED_ERRORS = 32
SERVICE = "pdserve.v1.KvTransfer"
PUSH_FRAMES = f"/{SERVICE}/PushFrames"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def serialize_kv_frame(frame: tuple[bytes, memoryview]) -> bytes:
    """KvFrame{header, payload} in protobuf wire format, copying the payload once.

    Building a KvFrame would copy it twice (bytes() for the field, then SerializeToString);
    this measured ~15% faster on loopback. Tested equal to the generated message's bytes.
    """
    header, payload = frame
    # Field 1 (header) and field 2 (payload), both wire type 2 (length-delimited).
    return b"".join(
        (b"\x0a", _varint(len(header)), header, b"\x12", _varint(len(payload)), payload)
    )


class WireFrame:
    """A KvFrame as it came off the wire: views into the message bytes (no copy), or the reason
    it could not be split (reported as that frame's rejection, not a dead stream)."""

    __slots__ = ("error", "header", "payload")

    def __init__(self, header=b"", payload=b"", error: str | None = None):
        self.header, self.payload, self.error = header, payload, error


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


_FIXED_SIZE = {1: 8, 5: 4}  # protobuf wire types 1 (64-bit) and 5 (32-bit)


def split_kv_frame(data: bytes) -> WireFrame:
    """Parse a KvFrame's protobuf wire format without copying the payload.

    The generated ``KvFrame.FromString`` copies the multi-MiB payload into a new bytes object;
    here header and payload are memoryviews of ``data``. Fields may come in any order, a repeated
    field's last value wins and unknown fields are skipped, as protobuf parsers do.
    """
    buf, pos, fields = memoryview(data), 0, {1: b"", 2: b""}
    try:
        while pos < len(buf):
            tag, pos = _read_varint(buf, pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 2:
                length, pos = _read_varint(buf, pos)
                if pos + length > len(buf):
                    raise ValueError("field runs past the end of the message")
                fields[number] = buf[pos : pos + length]
                pos += length
            elif wire_type == 0:
                _, pos = _read_varint(buf, pos)
            elif wire_type in _FIXED_SIZE:
                pos += _FIXED_SIZE[wire_type]
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
        if pos != len(buf):
            raise ValueError("field runs past the end of the message")
    except ValueError as e:
        return WireFrame(error=f"malformed KvFrame message: {e}")
    return WireFrame(fields[1], fields[2])


class KvTransferServicer(pdserve_pb2_grpc.KvTransferServicer):
    def __init__(self, receiver, token: str | None = None):
        self.receiver = receiver
        self.token = token

    def PushFrames(self, request_iterator, context):
        if self.token is not None:
            sent = dict(context.invocation_metadata()).get(TOKEN_KEY)
            if not token_matches(sent, self.token):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad cluster token")
        ack = pdserve_pb2.PushAck()
        for frame in request_iterator:
            reason = self._accept(frame)
            if reason is None:
                ack.frames_accepted += 1
                continue
            ack.frames_rejected += 1
            if len(ack.errors) < MAX_REPORTED_ERRORS:
                ack.errors.append(reason)
        return ack

    def _accept(self, frame: WireFrame) -> str | None:
        if frame.error is not None:
            return frame.error
        try:
            self.receiver.accept(frame.header, frame.payload)
        except FrameError as e:
            return e.reason
        except Exception as e:  # a receiver bug must not kill the stream for other frames
            log.exception("kv frame crashed the receiver")
            return f"internal error: {type(e).__name__}"
        return None


def add_kv_servicer(server: grpc.Server, receiver, token: str | None = None) -> None:
    """Host KvTransfer on an existing server (configure its message limits with
    ``message_options()``). Same method as the generated ``add_KvTransferServicer_to_server``,
    with a request parser that does not copy the payload."""
    handlers = {
        "PushFrames": grpc.stream_unary_rpc_method_handler(
            KvTransferServicer(receiver, token).PushFrames,
            request_deserializer=split_kv_frame,
            response_serializer=pdserve_pb2.PushAck.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62: no per-call lookup
        server.add_registered_method_handlers(SERVICE, handlers)


class GrpcReceiverServer(ReceiverServer):
    def __init__(self, receiver, host: str, port: int, max_workers: int = 8, token=None, tls=None):
        require_token_off_loopback(host, token, "gRPC KV receiver")
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-recv"),
            options=message_options() + EXCLUSIVE_PORT,
        )
        add_kv_servicer(self._server, receiver, token)
        address = f"[{host}]" if ":" in host else host
        bound = bind(self._server, f"{address}:{port}", tls)
        self.endpoint = f"{address}:{bound}"
        self._server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()


def _ended(error, what: str) -> ConnectionError:
    """A PushFrames call's failure as the sender reports it: UNAVAILABLE (the receiver refused
    or reset the connection, or went away) is the receiver's (ReceiverFault); anything else
    (a cancel, this side's channel closed) is a ConnectionError of this link."""
    code = error.code() if isinstance(error, grpc.RpcError) else None
    cls = ReceiverFault if code == grpc.StatusCode.UNAVAILABLE else ConnectionError
    name = code.name if code is not None else type(error).__name__
    details = error.details() if isinstance(error, grpc.RpcError) else str(error)
    return cls(f"{what}: {name}: {details}")


class _GrpcChannel(Channel):
    def __init__(self, push_frames, metadata, timeout_s: float):
        self._frames: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_FRAMES)
        self._call = push_frames.future(self._requests(), timeout=timeout_s, metadata=metadata)

    def _requests(self):
        while (frame := self._frames.get()) is not None:
            yield frame

    def _put(self, frame) -> None:
        while True:
            try:
                self._frames.put(frame, timeout=0.1)
                return
            except queue.Full:
                if self._call.done():  # the call died; nobody will drain the queue
                    raise _ended(self._call.exception(), "PushFrames ended early")

    def push(self, header, payload) -> None:
        self._put((header, payload))  # serialize_kv_frame makes the one copy, on grpc's thread

    def push_commit(self, header, payload) -> None:
        self.push(header, payload)
        self._put(None)

    def wait_ack(self, timeout: float) -> list[str]:
        try:
            ack = self._call.result(timeout=timeout)
        except grpc.RpcError as e:
            raise _ended(e, "PushFrames failed") from e
        errors = list(ack.errors)
        if ack.frames_rejected and not errors:
            errors = [f"{ack.frames_rejected} frames rejected"]
        return errors

    def cancel(self) -> None:
        self._call.cancel()
        while True:  # unblock the request iterator so grpc's consumer thread can finish
            try:
                self._frames.get_nowait()
            except queue.Empty:
                break
        try:
            self._frames.put_nowait(None)
        except queue.Full:  # the sender thread refilled it; the cancelled call ends anyway
            pass


def open_channel(endpoint: str, tls: ClusterTls | None, options: list) -> grpc.Channel:
    """A sync channel to a worker service: plaintext, or mutual TLS with the cluster's keys."""
    compression = grpc.Compression.NoCompression
    if tls is None:
        return grpc.insecure_channel(endpoint, options=options, compression=compression)
    return grpc.secure_channel(
        endpoint,
        tls.channel_credentials(),
        options=options + tls.channel_options(),
        compression=compression,
    )


class _GrpcLink(Link):
    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        stream_timeout_s: float = 120.0,
        tls: ClusterTls | None = None,
    ):
        # One channel per destination, shared by all streams: HTTP/2 multiplexes the calls.
        self._channel = open_channel(endpoint, tls, message_options())
        # The generated stub would build KvFrame messages; same method, leaner serializer.
        self._push_frames = self._channel.stream_unary(
            PUSH_FRAMES,
            request_serializer=serialize_kv_frame,
            response_deserializer=pdserve_pb2.PushAck.FromString,
        )
        self._metadata = ((TOKEN_KEY, token),) if token is not None else None
        self._timeout_s = stream_timeout_s

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        return _GrpcChannel(self._push_frames, self._metadata, self._timeout_s)

    def close(self) -> None:
        self._channel.close()


def connect(endpoint: str, **opts) -> Link:
    return _GrpcLink(endpoint, **opts)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return GrpcReceiverServer(receiver, host, port, **opts)
