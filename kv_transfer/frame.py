"""KV frame wire format: a msgpack header plus the raw bytes of one tensor.

A "kv" frame carries one layer's K and V for a list of blocks of one lease, named by their
position in the lease (block i holds the request's tokens [i*block_size, (i+1)*block_size)):
the sender never needs the decode side's block ids, so a prefill may start before the
reservation answers. Its payload is a
C-contiguous tensor ``[2, n_blocks, block_size, num_kv_heads, head_dim]`` (K then V) in native
(little-endian) byte order. A "commit" frame has an empty payload and tells the receiver how many
kv frames it should have accepted for the lease. The header is a msgpack map:

    {"version": 4, "kind": "kv" | "commit", "request_id": str, "lease_id": str,
     "layer": int, "blocks": [int], "dtype": str, "shape": [int], "checksum": int,
     "num_frames": int, ["heads": [lo, hi],] "header_crc": bin(4)}

``heads`` (kv frames, optional): the frame carries only the model's KV heads [lo, hi), one
tensor-parallel rank's slice (its shape's head dimension is hi - lo); the receiver writes them
into whichever of its ranks hold those heads, and the lease is complete when every head of
every layer x block has come (engine/tensor_parallel.py). Absent: all heads.

``header_crc``, always the map's last entry, is 4 bytes (msgpack bin 8, so the header ends
``c4 04`` + the CRC): the CRC-32C, little-endian, of every header byte before it. It covers
the fields the payload's checksum cannot: a bit flipped in ``layer``, ``blocks``,
``lease_id`` or ``num_frames`` would otherwise turn one valid header into another and land KV
in the wrong block, silently. A CRC-32C catches every error of up to 32 bits in a row, so any
damaged header byte is refused before a field is read. The receiver checks it over the bytes
it got (no re-encoding), then unpacks.

``checksum`` is the CRC-32C (Castagnoli) of the payload, with the CPU's CRC instruction: the
``crc32c`` package here (~20 GB/s on one core), or on CPU caches the sender's block gather,
which hashes while it copies (kernels/kv_blocks.py); ~5 GB/s for ``zlib.crc32`` (format
version 1) cost more than the socket for a 45 MiB prompt (sender and receiver each hash every
byte). No pickle: the receiver parses untrusted bytes and must never execute
them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import crc32c
import msgpack
import torch

from kv_transfer.errors import FrameError

# 4: a CRC-32C over the header (header_crc); 3: blocks named by position in the lease (2 sent
# the decode side's block ids); 2: CRC-32C checksums (1 was zlib's CRC-32).
FORMAT_VERSION = 4
# gRPC's default message limit is 4 MiB; leave room for the header and protobuf framing.
MAX_FRAME_BYTES = 3 * 1024 * 1024 + 512 * 1024
# Bounds the header (block list) so a hostile header cannot make us allocate much.
MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCKS_PER_FRAME = 4096
MAX_ID_LEN = 256
HEADER_CRC_KEY = "header_crc"
# msgpack's bin 8 marker for a 4-byte value: the header's last value is its CRC, in place.
_HEADER_CRC_MARK = b"\xc4\x04"
_HEADER_CRC_BYTES = 4

KINDS = ("kv", "commit")
# Only plain numeric dtypes travel; names map to torch dtypes without getattr on user input.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_KV_RANK = 5

# decode_frame views read-only buffers (protobuf bytes) without copying and only ever reads
# them; torch warns about that once per process. Scoped to this module.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, __name__)


@dataclass(frozen=True)
class FrameHeader:
    version: int
    kind: str  # "kv" | "commit"
    request_id: str
    lease_id: str
    layer: int  # -1 on commit frames
    blocks: tuple[int, ...]  # positions in the lease of the blocks carried (not block ids)
    dtype: str  # a key of DTYPES; "" on commit frames
    shape: tuple[int, ...]  # [2, n_blocks, block_size, num_kv_heads, head_dim]; () on commit
    checksum: int  # CRC-32C of the payload
    num_frames: int = 0  # commit frames only: kv frames sent for the lease before the commit
    # kv frames of one tensor-parallel rank's slice: the model's KV heads [lo, hi) it carries
    # (shape[3] == hi - lo); None: every KV head of the model.
    heads: tuple[int, int] | None = None


def checksum(payload) -> int:
    """CRC-32C of a byte buffer (bytes, memoryview, anything with the buffer protocol)."""
    return crc32c.crc32c(payload)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot travel in a KV frame; allowed: {sorted(DTYPES)}")
    return name


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def encode_kv_frame(
    request_id: str,
    lease_id: str,
    layer: int,
    blocks,
    kv: torch.Tensor,
    crc: int | None = None,
    heads: tuple[int, int] | None = None,
) -> tuple[bytes, memoryview]:
    """Encode one layer's K/V for the lease's ``blocks`` (positions in the lease); the
    payload is a view of ``kv`` (no copy). ``crc``: the payload's CRC-32C when the caller
    already has it (computed while gathering the blocks), else it is computed here.
    ``heads``: the model's KV heads [lo, hi) that ``kv`` holds (one tensor-parallel rank's
    slice); None: all of them."""
    kv = kv.detach()
    if kv.device.type != "cpu":
        kv = kv.cpu()
    kv = kv.contiguous()
    blocks = tuple(int(b) for b in blocks)
    if kv.dim() != _KV_RANK or kv.shape[0] != 2 or kv.shape[1] != len(blocks):
        raise ValueError(f"kv shape {tuple(kv.shape)} is not [2, {len(blocks)}, bs, h, d]")
    payload = tensor_bytes(kv)
    header = {
        "version": FORMAT_VERSION,
        "kind": "kv",
        "request_id": request_id,
        "lease_id": lease_id,
        "layer": int(layer),
        "blocks": list(blocks),
        "dtype": dtype_name(kv.dtype),
        "shape": list(kv.shape),
        "checksum": checksum(payload) if crc is None else int(crc),
        "num_frames": 0,
    }
    if heads is not None:
        header["heads"] = [int(heads[0]), int(heads[1])]
    return seal_header(header), payload


def encode_commit_frame(request_id: str, lease_id: str, num_frames: int) -> tuple[bytes, bytes]:
    header = {
        "version": FORMAT_VERSION,
        "kind": "commit",
        "request_id": request_id,
        "lease_id": lease_id,
        "layer": -1,
        "blocks": [],
        "dtype": "",
        "shape": [],
        "checksum": checksum(b""),
        "num_frames": int(num_frames),
    }
    return seal_header(header), b""


def seal_header(fields: dict) -> bytes:
    """Pack header ``fields`` as a msgpack map ending with their ``header_crc``."""
    fields = {k: v for k, v in fields.items() if k != HEADER_CRC_KEY}
    fields[HEADER_CRC_KEY] = bytes(_HEADER_CRC_BYTES)  # a placeholder of the CRC's size
    body = msgpack.packb(fields)[:-_HEADER_CRC_BYTES]
    return body + checksum(body).to_bytes(_HEADER_CRC_BYTES, "little")


def _check_header_crc(raw: memoryview) -> None:
    """Refuse a header whose bytes are not the ones its sender sealed."""
    mark_at = raw.nbytes - _HEADER_CRC_BYTES - len(_HEADER_CRC_MARK)
    if mark_at < 0 or raw[mark_at : mark_at + len(_HEADER_CRC_MARK)] != _HEADER_CRC_MARK:
        raise FrameError("malformed header: it does not end with its header_crc")
    body = raw[: raw.nbytes - _HEADER_CRC_BYTES]
    sent = int.from_bytes(raw[raw.nbytes - _HEADER_CRC_BYTES :], "little")
    if checksum(body) != sent:
        raise FrameError("header checksum mismatch")


def _unpack_header(header, max_bytes: int = MAX_HEADER_BYTES) -> dict:
    try:
        raw = memoryview(header).cast("B")
    except (TypeError, ValueError):
        raise FrameError(f"header is {type(header).__name__}, not bytes") from None
    if raw.nbytes > max_bytes:
        raise FrameError(f"header of {raw.nbytes} bytes exceeds {max_bytes}")
    _check_header_crc(raw)
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    # msgpack raises many exception types on garbage; all of them mean "not a header".
    except Exception as e:  # noqa: BLE001
        raise FrameError(f"malformed header: {type(e).__name__}") from None
    if not isinstance(fields, dict) or list(fields)[-1:] != [HEADER_CRC_KEY]:
        raise FrameError("malformed header: not a msgpack map ending with its header_crc")
    return fields


def unpack_sealed(header, max_bytes: int = MAX_HEADER_BYTES) -> dict:
    """The fields of a map ``seal_header`` packed, once its header_crc matches its bytes
    (the nixl transport seals its commit notification's own fields so); FrameError if not."""
    return _unpack_header(header, max_bytes)


def _field(fields: dict, name: str, kind: type):
    value = fields.get(name)
    # bool is an int subclass; a bool where a number belongs is a malformed header.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FrameError(f"header field {name!r} missing or not {kind.__name__}")
    return value


def _int_list(fields: dict, name: str, max_len: int) -> tuple[int, ...]:
    values = _field(fields, name, list)
    if len(values) > max_len:
        raise FrameError(f"header field {name!r} has {len(values)} entries (max {max_len})")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise FrameError(f"header field {name!r} must hold non-negative ints")
    return tuple(values)


def _parse_header(fields: dict) -> FrameHeader:
    version = _field(fields, "version", int)
    if version != FORMAT_VERSION:
        raise FrameError(f"unsupported frame version {version} (expected {FORMAT_VERSION})")
    kind = _field(fields, "kind", str)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind[:32]!r}")
    ids = {name: _field(fields, name, str) for name in ("request_id", "lease_id")}
    if not all(0 < len(v) <= MAX_ID_LEN for v in ids.values()):
        raise FrameError("request_id and lease_id must be 1-256 characters")
    dtype = _field(fields, "dtype", str)
    if kind == "kv" and dtype not in DTYPES:
        raise FrameError(f"dtype {dtype[:32]!r} not allowed")
    return FrameHeader(
        version=version,
        kind=kind,
        request_id=ids["request_id"],
        lease_id=ids["lease_id"],
        layer=_field(fields, "layer", int),
        blocks=_int_list(fields, "blocks", MAX_BLOCKS_PER_FRAME),
        dtype=dtype,
        shape=_int_list(fields, "shape", 8),
        checksum=_field(fields, "checksum", int),
        num_frames=_field(fields, "num_frames", int),
        heads=_heads(fields),
    )


def _heads(fields: dict) -> tuple[int, int] | None:
    if "heads" not in fields:
        return None
    lo, hi = (*_int_list(fields, "heads", 2), -1, -1)[:2]
    if not 0 <= lo < hi:
        raise FrameError("header field 'heads' must be [lo, hi] with 0 <= lo < hi")
    return lo, hi


def _check_kv_header(h: FrameHeader) -> None:
    if h.layer < 0:
        raise FrameError(f"layer {h.layer} is negative")
    if not h.blocks:
        raise FrameError("kv frame names no blocks")
    if len(set(h.blocks)) != len(h.blocks):
        raise FrameError("kv frame repeats a block")
    if len(h.shape) != _KV_RANK or h.shape[0] != 2 or h.shape[1] != len(h.blocks):
        raise FrameError(f"shape {list(h.shape)} is not [2, {len(h.blocks)}, bs, h, d]")
    if h.heads is not None and h.heads[1] - h.heads[0] != h.shape[3]:
        raise FrameError(f"heads {list(h.heads)} do not match the shape's {h.shape[3]} heads")


def _payload_view(payload) -> memoryview:
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.device.type != "cpu":
            raise FrameError("tensor payload must be a CPU uint8 tensor")
        return tensor_bytes(payload.contiguous())
    try:
        return memoryview(payload).cast("B")
    except (TypeError, ValueError):
        raise FrameError(f"payload is {type(payload).__name__}, not a byte buffer") from None


def decode_frame(header, payload) -> tuple[FrameHeader, torch.Tensor | None]:
    """Validate a frame; return its header and (kv frames) a tensor viewing the payload.

    ``payload`` may be bytes, any buffer, or a CPU uint8 tensor. Raises FrameError with a
    reason on anything malformed; never anything else.
    """
    h = _parse_header(_unpack_header(header))
    data = _payload_view(payload)
    if h.kind == "commit":
        if data.nbytes:
            raise FrameError(f"commit frame carries {data.nbytes} payload bytes")
        if h.num_frames < 0:
            raise FrameError(f"commit num_frames {h.num_frames} is negative")
        return h, None
    _check_kv_header(h)
    dtype = DTYPES[h.dtype]
    expected = math.prod(h.shape) * dtype.itemsize
    if data.nbytes != expected:
        raise FrameError(f"payload is {data.nbytes} bytes; shape {list(h.shape)} needs {expected}")
    if checksum(data) != h.checksum:
        raise FrameError("payload checksum mismatch")
    if expected == 0:
        return h, torch.empty(h.shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return h, flat.view(dtype).view(h.shape)
