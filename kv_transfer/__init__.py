"""Moving KV-cache blocks from a prefill worker to a decode worker (see frame.py for the wire)."""

from kv_transfer.frame import (
    FORMAT_VERSION,
    MAX_FRAME_BYTES,
    FrameError,
    FrameHeader,
    decode_frame,
    encode_commit_frame,
    encode_kv_frame,
)
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import (
    TRANSPORTS,
    KVSender,
    KVStream,
    ReceiverServer,
    TransferError,
    TransferStats,
    make_sender,
    start_receiver_server,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_FRAME_BYTES",
    "TRANSPORTS",
    "FrameError",
    "FrameHeader",
    "KVReceiver",
    "KVSender",
    "KVStream",
    "Lease",
    "LeaseTable",
    "ReceiverServer",
    "TransferError",
    "TransferStats",
    "decode_frame",
    "encode_commit_frame",
    "encode_kv_frame",
    "make_sender",
    "start_receiver_server",
]
