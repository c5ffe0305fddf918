"""The nixl transport's commit notification, and the digest of the KV it commits.

After its last WRITE completed, the sender notifies the receiver's agent with

    u16 length of A | A: the commit frame header (kv_transfer.frame.encode_commit_frame:
                         request, lease, kv write count; CRC-sealed)
                    | B: a map sealed the same way (kv_transfer.frame.seal_header):
                         {"lease_id": str, "writes": [[layer, [[start, count], ...]], ...],
                          "bytes": int, "digest": int}

``writes`` names, per WRITE, the layer and the lease positions it filled (runs of
positions); the receiver checks them against the lease and its cache (a layer past the model,
a position past the lease: refused) and records them as the frames it would have received.
``digest`` is the CRC-32C over the per-cell CRC-32Cs (K then V of each (layer, position), in
ascending order) of the bytes the sender wrote; the receiver computes the same over its
leased blocks before it commits, so KV that did not land where the lease says (lost, damaged,
written elsewhere) fails the commit. -1: no digest (caches in GPU memory, where hashing on the
host would cost a copy); a receiver with a host cache requires one.

A flipped bit anywhere fails A's or B's CRC; B's lease must be A's.

Each layer's WRITE also carries a notification of its own, ``WRITTEN`` (two zero bytes: no
commit has an empty header) then a sealed map {"lease_id", "write": its index in
``writes``, "layer", "runs"}: NIXL delivers it once that WRITE's bytes are in place, so the
receiver hashes those blocks then, while later layers are still being computed and written,
and the commit's check reuses those CRCs (see NixlReceiverServer._verifier for why that is
sound) instead of hashing the whole push after the last WRITE.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from kv_transfer.errors import FrameError
from kv_transfer.frame import FrameHeader, decode_frame, seal_header, unpack_sealed

NO_DIGEST = -1
MAX_NOTIFICATION_BYTES = 4 * 1024 * 1024
_LEN = struct.Struct("<H")


@dataclass(frozen=True)
class NixlCommit:
    header: FrameHeader  # the commit frame's header (kind "commit", num_frames: writes)
    writes: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, lease positions) per WRITE
    nbytes: int
    digest: int  # NO_DIGEST or the CRC-32C of the cells' CRCs


def runs(positions) -> list[list[int]]:
    """[[start, count], ...] of sorted-or-not positions, one run per consecutive stretch."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([int(p), 1])
    return out


def encode_notification(frame_header: bytes, lease_id: str, writes, nbytes: int, digest: int):
    """The notification bytes: ``writes`` is [(layer, positions)] per WRITE."""
    extra = seal_header(
        {
            "lease_id": lease_id,
            "writes": [[int(layer), runs(pos)] for layer, pos in writes],
            "bytes": int(nbytes),
            "digest": int(digest),
        }
    )
    return _LEN.pack(len(frame_header)) + bytes(frame_header) + extra


WRITTEN = b"\x00\x00"


@dataclass(frozen=True)
class Written:
    lease_id: str
    index: int  # the WRITE's index in the commit's ``writes``
    layer: int
    positions: tuple[int, ...]


def encode_written(lease_id: str, index: int, layer: int, positions) -> bytes:
    fields = {"lease_id": lease_id, "write": int(index), "layer": int(layer)}
    return WRITTEN + seal_header({**fields, "runs": runs(positions)})


def decode_written(message: bytes, max_positions: int = 1 << 20) -> Written:
    """A per-WRITE notification's fields; FrameError if its CRC or a field is wrong."""
    fields = unpack_sealed(message[len(WRITTEN) :], MAX_NOTIFICATION_BYTES)
    lease_id, index, layer = (fields.get(k) for k in ("lease_id", "write", "layer"))
    if not (isinstance(lease_id, str) and _is_count(index) and _is_count(layer)):
        raise FrameError("write notification: lease_id, write or layer malformed")
    return Written(lease_id, index, layer, _positions(fields.get("runs"), max_positions))


def _positions(spans, limit: int) -> tuple[int, ...]:
    if not isinstance(spans, list) or len(spans) > limit:
        raise FrameError("commit notification: bad runs of positions")
    out: list[int] = []
    for span in spans:
        if not (isinstance(span, list) and len(span) == 2 and all(_is_count(v) for v in span)):
            raise FrameError("commit notification: a run is not [start, count]")
        start, count = span
        if count > limit or start > limit:
            raise FrameError("commit notification: a run names too many positions")
        out.extend(range(start, start + count))
    return tuple(out)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def decode_notification(message: bytes, max_positions: int = 1 << 20) -> NixlCommit:
    """Validate a commit notification; FrameError with a reason on anything malformed."""
    if len(message) > MAX_NOTIFICATION_BYTES or len(message) < _LEN.size:
        raise FrameError(f"commit notification of {len(message)} bytes")
    (size,) = _LEN.unpack_from(message)
    head, extra = message[_LEN.size : _LEN.size + size], message[_LEN.size + size :]
    h, _ = decode_frame(head, b"")  # the frame's own checks: header CRC, version, ids
    if h.kind != "commit":
        raise FrameError(f"commit notification carries a {h.kind} frame")
    fields = unpack_sealed(extra, MAX_NOTIFICATION_BYTES)
    if fields.get("lease_id") != h.lease_id:
        raise FrameError("commit notification: its two parts name different leases")
    raw_writes, nbytes, digest = (fields.get(k) for k in ("writes", "bytes", "digest"))
    if not isinstance(raw_writes, list) or not _is_count(nbytes):
        raise FrameError("commit notification: writes or bytes malformed")
    if not isinstance(digest, int) or isinstance(digest, bool) or digest < NO_DIGEST:
        raise FrameError("commit notification: digest malformed")
    writes = []
    for entry in raw_writes:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_count(entry[0])):
            raise FrameError("commit notification: a write is not [layer, runs]")
        writes.append((entry[0], _positions(entry[1], max_positions)))
    return NixlCommit(h, tuple(writes), nbytes, digest)


def block_rows(cache: torch.Tensor) -> np.ndarray:
    """A [num_blocks, block bytes] uint8 view of a host cache tensor (no copy)."""
    return cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()


def cell_crcs(k_rows: np.ndarray, v_rows: np.ndarray, block_ids) -> list[tuple[int, int]]:
    """(CRC-32C of K, of V) of each block in ``block_ids``."""
    return [(crc32c.crc32c(k_rows[b]), crc32c.crc32c(v_rows[b])) for b in block_ids]


def digest(cells: dict[tuple[int, int], tuple[int, int]]) -> int:
    """The commit's digest of {(layer, position): (crc K, crc V)}, in ascending order."""
    ordered = np.array([cells[key] for key in sorted(cells)], dtype="<u4")
    return crc32c.crc32c(ordered.tobytes())


def notification_key(message: bytes) -> int:
    """What an ack names its commit notification by (both sides compute it). Not the
    message's CRC32C: a message ending in its own CRC (a sealed header) has the same CRC32C
    as every other such message (the CRC residue), and acks would take each other's
    verdicts."""
    return int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little")
