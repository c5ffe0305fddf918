"""Arrow Flight transport: KV frames over gRPC's C++ core, payloads never copied in Python.

Python grpcio copies every received message three times before handing it over (each TCP
slice into a bytes object, that into a bytearray, the bytearray into the final bytes) and the
sent one once: a bare grpcio stream reaches ~0.3x of loopback here, whatever the framing on
top. Arrow Flight (pyarrow) is gRPC too, HTTP/2 and protobuf ``FlightData`` messages, run by
gRPC's C++ API: a record batch's body goes to gRPC as slices of the caller's buffer and comes
back as a buffer the handler reads in place, with the GIL released around the I/O.

One ``DoPut`` call per KVStream (descriptor: the lease id). A kv frame is one ``FlightData``:
``app_metadata`` is the frame's msgpack header (frame.py), the body a record batch of one
``uint8`` column viewing the payload. The commit frame is a metadata-only message. The server
answers once, after the client finished writing: msgpack ``{"accepted", "rejected", "errors"}``.
It keeps consuming after a bad frame and reports every rejection there, as the grpc transport
does. With a cluster token, a call without ``x-pdserve-token`` is refused (UNAUTHENTICATED).
pyarrow's Flight server sets no message size limit and exposes none: senders keep frames under
MAX_FRAME_BYTES, and only a caller with the token gets a stream at all (without a token the
server listens on loopback only).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import msgpack
import pyarrow as pa
from pyarrow import flight

from grpc_plumbing.auth import TOKEN_KEY, require_token_off_loopback, token_matches
from grpc_plumbing.tls import read_pem
from kv_transfer.errors import FrameError
from kv_transfer.interfaces import Channel, Link, ReceiverServer

log = logging.getLogger("pdserve.kv")

SCHEMA = pa.schema([pa.field("kv", pa.uint8(), nullable=False)])
MAX_REPORTED_ERRORS = 32
MAX_ACK_BYTES = 64 * 1024


def _payload_of(chunk) -> memoryview:
    """The kv bytes of a record batch, in place; FrameError if it is not one plain column."""
    batch = chunk.data
    if batch.num_columns != 1:
        raise FrameError(f"record batch has {batch.num_columns} columns, not 1")
    column = batch.column(0)
    if column.type != pa.uint8() or column.null_count or column.offset:
        raise FrameError("record batch column is not plain uint8 without nulls or offset")
    data = column.buffers()[1]
    if data is None or data.size < len(column):
        raise FrameError("record batch column's data buffer is short")
    return memoryview(data)[: len(column)]


class _TokenCheck(flight.ServerMiddlewareFactory):
    def __init__(self, token: str):
        self._token = token

    def start_call(self, info, headers):
        sent = headers.get(TOKEN_KEY) or [""]
        if not token_matches(sent[0], self._token):
            raise flight.FlightUnauthenticatedError("bad cluster token")


def _tls_server_args(tls) -> dict:
    if tls is None:
        return {}
    pem = (read_pem(tls.cert, "cert"), read_pem(tls.key, "key"))
    return {
        "tls_certificates": [flight.CertKeyPair(*pem)],
        "verify_client": True,  # mutual TLS: only cluster key holders connect
        "root_certificates": read_pem(tls.ca, "ca"),
    }


def _tls_client_args(tls) -> dict:
    if tls is None:
        return {}
    args = {
        "tls_root_certs": read_pem(tls.ca, "ca"),
        "cert_chain": read_pem(tls.cert, "cert"),
        "private_key": read_pem(tls.key, "key"),
    }
    if tls.server_name:
        args["override_hostname"] = tls.server_name
    return args


class _KvFlightServer(flight.FlightServerBase):
    def __init__(self, location: str, receiver, token: str | None, tls=None):
        middleware = {"token": _TokenCheck(token)} if token is not None else None
        super().__init__(location, middleware=middleware, **_tls_server_args(tls))
        self.receiver = receiver

    def do_put(self, context, descriptor, reader, writer):
        if not reader.schema.equals(SCHEMA):
            raise flight.FlightServerError(
                f"kv stream schema must be {SCHEMA}, got {reader.schema}"
            )
        counts, errors = {"accepted": 0, "rejected": 0}, []
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            reason = self._accept(chunk)
            counts["accepted" if reason is None else "rejected"] += 1
            if reason is not None and len(errors) < MAX_REPORTED_ERRORS:
                errors.append(reason)
        writer.write(pa.py_buffer(msgpack.packb({**counts, "errors": errors})))

    def _accept(self, chunk) -> str | None:
        try:
            if chunk.app_metadata is None:
                raise FrameError("message carries no frame header")
            payload = b"" if chunk.data is None else _payload_of(chunk)
            self.receiver.accept(memoryview(chunk.app_metadata), payload)
        except FrameError as e:
            return e.reason
        except Exception as e:  # a receiver bug must not kill the stream for other frames
            log.exception("kv frame crashed the receiver")
            return f"internal error: {type(e).__name__}"
        return None


class FlightReceiverServer(ReceiverServer):
    def __init__(self, receiver, host: str, port: int, token: str | None = None, tls=None):
        # pyarrow sets no message size limit on a Flight server: only token holders may send.
        require_token_off_loopback(host, token, "Flight KV receiver")
        address = f"[{host}]" if ":" in host else host
        scheme = "grpc+tls" if tls is not None else "grpc+tcp"
        self._server = _KvFlightServer(f"{scheme}://{address}:{port}", receiver, token, tls)
        self.endpoint = f"{address}:{self._server.port}"

    def stop(self, grace_s: float = 1.0) -> None:
        # Flight's shutdown waits for every open call, and a stream whose sender stalls stays
        # open until the sender's deadline: wait ``grace_s``, then leave it draining.
        stopper = threading.Thread(target=self._server.shutdown, name="kv-flight-stop", daemon=True)
        stopper.start()
        stopper.join(grace_s)
        if stopper.is_alive():
            log.warning("kv flight server at %s still has open streams; not waiting", self.endpoint)


def _parse_ack(buf) -> list[str]:
    if buf is None:
        raise ConnectionError("kv stream ended without the receiver's acknowledgement")
    if buf.size > MAX_ACK_BYTES:
        raise ConnectionError(f"kv acknowledgement of {buf.size} bytes")
    ack = msgpack.unpackb(memoryview(buf), raw=False)
    errors = [str(e) for e in ack.get("errors", [])]
    if ack.get("rejected") and not errors:
        errors = [f"{ack['rejected']} frames rejected"]
    return errors


class _FlightChannel(Channel):
    def __init__(self, client: flight.FlightClient, options, lease_id: str):
        self._client, self._options, self._lease_id = client, options, lease_id
        self._writer = self._acks = None
        self._ack: Future | None = None

    def _open(self):
        # On the sender thread, at the first frame: a dead receiver fails the stream's commit
        # (TransferError), as with the other transports, not the caller opening it.
        if self._writer is None:
            descriptor = flight.FlightDescriptor.for_command(self._lease_id.encode())
            self._writer, self._acks = self._client.do_put(
                descriptor, SCHEMA, options=self._options
            )
        return self._writer

    def push(self, header, payload) -> None:
        # Views, no copies: gRPC sends the payload's bytes from where the sender gathered them.
        column = pa.Array.from_buffers(pa.uint8(), len(payload), [None, pa.py_buffer(payload)])
        batch = pa.RecordBatch.from_arrays([column], schema=SCHEMA)
        self._open().write_with_metadata(batch, pa.py_buffer(header))

    def push_commit(self, header, payload) -> None:
        writer = self._open()
        writer.write_metadata(pa.py_buffer(header))
        writer.done_writing()
        self._ack = Future()
        threading.Thread(target=self._read_ack, name="kv-ack", daemon=True).start()

    def _read_ack(self) -> None:
        try:
            buf = self._acks.read()
            self._writer.close()  # raises the call's error when the receiver ended it with one
            self._ack.set_result(_parse_ack(buf))
        except Exception as e:  # noqa: BLE001 - handed to the committing thread
            if not self._ack.done():
                self._ack.set_exception(e)

    def wait_ack(self, timeout: float) -> list[str]:
        if self._ack is None:
            raise RuntimeError("wait_ack before push_commit")
        return self._ack.result(timeout)

    def cancel(self) -> None:
        if self._writer is None:
            return
        try:  # ends the call without a commit: the receiver acknowledges nothing, the lease expires
            self._writer.close()
        except Exception as e:  # noqa: BLE001 - the call may already have failed
            log.debug("closing a cancelled kv stream: %s", e)


class _FlightLink(Link):
    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        stream_timeout_s: float = 120.0,
        tls=None,
    ):
        # One client per destination, shared by all streams: gRPC multiplexes the calls.
        scheme = "grpc+tls" if tls is not None else "grpc+tcp"
        self._client = flight.FlightClient(f"{scheme}://{endpoint}", **_tls_client_args(tls))
        headers = [(TOKEN_KEY.encode(), token.encode())] if token is not None else []
        self._options = flight.FlightCallOptions(timeout=stream_timeout_s, headers=headers)

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        return _FlightChannel(self._client, self._options, lease_id)

    def close(self) -> None:
        self._client.close()


def connect(endpoint: str, **opts) -> Link:
    return _FlightLink(endpoint, **opts)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return FlightReceiverServer(receiver, host, port, **opts)
