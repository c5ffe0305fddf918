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
``digest`` covers the bytes the sender wrote, as they must end up in the lease's blocks: per
WRITE, the XXH3-64 of its K cells' bytes concatenated in the WRITE's position order, and the
same of its V cells, over the positions no later WRITE of the same layer rewrites (a chunk's
partial last block is written again by the next chunk); the digest is the XXH3-64 of those
(K, V) pairs in WRITE order. The hash is of the bytes, not of where they lie: each side
streams its own contiguous stretches of blocks into it (the sender's and the receiver's
differ), one call per stretch, instead of one call per 12 KiB cell. The receiver computes the
same over its leased blocks before it commits, so KV that did not land where the lease says
(lost, damaged, written elsewhere) fails the commit. -1: no digest (caches in GPU memory,
where hashing on the host would cost a copy); a receiver with a host cache requires one.

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

import numpy as np
import torch
import xxhash

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
    digest: int  # NO_DIGEST or the XXH3-64 of the WRITEs' hashes (module docstring)


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


def block_runs(block_ids) -> list[tuple[int, int]]:
    """(first block, count) of each stretch of consecutive ids in ``block_ids``, in order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1])
    counts = np.diff(np.append(starts, ids.size))
    return list(zip(ids[starts].tolist(), counts.tolist()))


def write_hashes(k_rows: np.ndarray, v_rows: np.ndarray, block_ids) -> tuple[int, int]:
    """XXH3-64 of the K cells of ``block_ids`` concatenated in that order, and of the V
    cells; ``k_rows`` / ``v_rows``: [blocks, bytes] (block_rows). Each stretch of
    consecutive blocks goes in as one buffer (XXH3 streams: the result depends on the bytes
    and their order only). XXH3 releases the GIL and runs at ~2x CRC-32C's speed here."""
    k, v = xxhash.xxh3_64(), xxhash.xxh3_64()
    for start, count in block_runs(block_ids):
        k.update(k_rows[start : start + count])
        v.update(v_rows[start : start + count])
    return k.intdigest(), v.intdigest()


def final_positions(writes) -> list[tuple[int, ...]]:
    """Per WRITE (layer, positions), in order: its positions that no later WRITE of the same
    layer rewrites (their bytes are the ones the lease keeps)."""
    later: dict[int, set[int]] = {}  # layer -> positions written after the one looked at
    out = []
    for layer, positions in reversed(writes):
        seen = later.setdefault(int(layer), set())
        out.append(tuple(p for p in positions if p not in seen))
        seen.update(positions)
    return out[::-1]


def digest(hashes) -> int:
    """The commit's digest of each WRITE's (K hash, V hash) over its final positions, in WRITE
    order."""
    return xxhash.xxh3_64_intdigest(np.array(list(hashes), dtype="<u8").reshape(-1, 2).tobytes())


class SentHashes:
    """A one-sided sender's side of the digest: each write hashed from its source blocks as it
    is sent, the commit's digest at the end."""

    def __init__(self):
        # per write: layer, lease positions, source blocks, the source caches' rows, its
        # (K, V) hashes, and 1 where the faults transport had it damaged (0 otherwise)
        self._records: list[tuple[int, list[int], list[int], tuple, tuple[int, int], int]] = []

    def add(self, layer: int, src, dst, k_cache, v_cache, damage: bool = False) -> None:
        rows = (block_rows(k_cache), block_rows(v_cache))
        k_hash, v_hash = write_hashes(*rows, src)
        flip = int(damage)  # as if a bit of its bytes flipped on the way
        self._records.append((layer, list(dst), list(src), rows, (k_hash ^ flip, v_hash), flip))

    def digest(self) -> int:
        """A write that a later one of its layer rewrote in part (a chunk's partial last
        block) is hashed again over the positions it keeps, from its source blocks (which do
        not change once sent)."""
        hashes = []
        finals = final_positions([(r[0], r[1]) for r in self._records])
        for (_, dst, src, rows, hashed, flip), final in zip(self._records, finals):
            if len(final) == len(dst):
                hashes.append(hashed)
                continue
            source = dict(zip(dst, src))
            k_hash, v_hash = write_hashes(*rows, [source[p] for p in final])
            hashes.append((k_hash ^ flip, v_hash))
        return digest(hashes)


def notification_key(message: bytes) -> int:
    """What an ack names its commit notification by (both sides compute it). Not the
    message's CRC32C: a message ending in its own CRC (a sealed header) has the same CRC32C
    as every other such message (the CRC residue), and acks would take each other's
    verdicts."""
    return int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little")
