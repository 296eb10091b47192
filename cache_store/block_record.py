"""One cached KV block outside the device pool: identity, verification data and payload.

A record is what the lower tiers (disk, a peer, the remote store) hold for one
block. Its metadata (:class:`RecordMeta`) says which block it is and how to
check it; its payload is the block encoded with a codec of
:mod:`cache_store.kv_codec`.

Byte format (``RECORD_FORMAT_VERSION`` 1, all integers little-endian), a
fixed header of ``HEADER_BYTES`` bytes followed by the token ids and the
payload::

    magic            4s   b"KVB1"
    version          u16  RECORD_FORMAT_VERSION
    num_tokens       u16  tokens in the block (the block size)
    block_hash       16s  chained hash (cache_store.hashing)
    parent_hash      16s  hash of the block before; 16 zero bytes for block 0
    codec            8s   codec name, ASCII, zero padded
    dtype            12s  pool dtype name ("float32", "bfloat16", ...), zero padded
    shape            5 x u32  (layers, 2, kv_heads, block_size, head_dim)
    payload_len      u64  bytes of payload
    payload_checksum u64  xxh3_64 of the payload
    header_checksum  u64  xxh3_64 of every header byte before this field,
                          followed by the token bytes
    tokens           num_tokens x u32
    payload          payload_len bytes

What verification proves (:meth:`RecordMeta.verify_for`): the record's hash is
the requester's hash for that position, its parent is the requester's
previous hash, its tokens are the requester's tokens, and
``xxh3_128(parent_or_namespace_root || tokens)`` recomputes to the hash. The
namespace (model, tenant salt, adapter) is therefore checked through the
chain: block 0's hash is recomputed from the requester's own namespace root.
The dtype and shape must equal the loading pool's, the codec must be known,
and the payload must match its checksum (:func:`verify_payload`).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch
import xxhash

from kvmesh.cache_store.hashing import HASH_BYTES, hash_block
from kvmesh.cache_store.kv_codec import CODECS

__all__ = [
    "RECORD_FORMAT_VERSION",
    "HEADER_BYTES",
    "ZERO_HASH",
    "RecordError",
    "RecordMeta",
    "encode_record",
    "parse_header",
    "decode_record",
    "verify_payload",
    "host_meta",
    "checksum",
    "dtype_name",
]

RECORD_FORMAT_VERSION = 1
MAGIC = b"KVB1"
ZERO_HASH = bytes(HASH_BYTES)

_HEAD = struct.Struct("<4sHH16s16s8s12s5IQQ")
_TAIL = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _TAIL.size


class RecordError(ValueError):
    """A record failed a check: bad magic or version, checksum mismatch, truncation,
    or metadata that does not match what the reader expects."""


def checksum(data) -> int:
    """xxh3_64 of a bytes-like object (payload checksum)."""
    return xxhash.xxh3_64_intdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


class RecordMeta(NamedTuple):
    """Everything about a stored block except its payload.

    Attributes:
        block_hash: 16-byte chained hash.
        parent_hash: hash of the previous block; ``ZERO_HASH`` for block 0.
        token_bytes: the block's token ids, little-endian uint32 (4 x block_size bytes).
        codec: codec name of the payload.
        dtype: pool dtype name.
        shape: ``(layers, 2, kv_heads, block_size, head_dim)``.
        payload_len: payload size (bytes).
        payload_checksum: xxh3_64 of the payload.
    """

    block_hash: bytes
    parent_hash: bytes
    token_bytes: bytes
    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    payload_checksum: int

    @property
    def parent(self) -> bytes | None:
        """``parent_hash``, or None for block 0 (the form KV events use)."""
        return None if self.parent_hash == ZERO_HASH else self.parent_hash

    @property
    def record_len(self) -> int:
        """Bytes of the whole encoded record (header + tokens + payload)."""
        return HEADER_BYTES + len(self.token_bytes) + self.payload_len

    def verify_for(self, block_hash: bytes, parent: bytes | None, token_bytes: bytes, root: bytes,
                   dtype: str, shape: tuple[int, ...]) -> None:
        """Check this record against the block a requester expects at one position.

        Args:
            block_hash: the requester's hash of the block.
            parent: the requester's previous block hash; None for block 0.
            token_bytes: the requester's token bytes of the block.
            root: the requester's namespace root hash (parent of block 0).
            dtype, shape: the requester's pool dtype name and block shape.

        Raises:
            RecordError: any field disagrees, the codec is unknown, or the hash
                does not recompute from (parent or root, tokens).
        """
        if self.block_hash != block_hash:
            raise RecordError("block hash differs")
        if self.parent_hash != (parent if parent is not None else ZERO_HASH):
            raise RecordError("parent hash differs")
        if self.token_bytes != token_bytes:
            raise RecordError("token ids differ")
        if hash_block(parent if parent is not None else root, self.token_bytes) != self.block_hash:
            raise RecordError("hash does not recompute from parent (or namespace root) and tokens")
        if self.dtype != dtype or tuple(self.shape) != tuple(shape):
            raise RecordError(f"layout {self.dtype}{list(self.shape)} != pool's {dtype}{list(shape)}")
        if self.codec not in CODECS:
            raise RecordError(f"unknown codec {self.codec!r}")


def host_meta(block_hash: bytes, parent_hash: bytes, token_bytes: bytes, codec: str, dtype: str,
              shape: tuple[int, ...], payload_len: int) -> RecordMeta:
    """Metadata of a block held in memory, whose payload checksum is not computed (0)."""
    return RecordMeta(block_hash, parent_hash, token_bytes, codec, dtype, tuple(shape), payload_len, 0)


def _pad(s: str, n: int, what: str) -> bytes:
    b = s.encode("ascii")
    if len(b) > n:
        raise ValueError(f"{what} {s!r} longer than {n} bytes")
    return b.ljust(n, b"\0")


def encode_header(meta: RecordMeta) -> bytes:
    """Header + token bytes of a record (everything before the payload).

    Raises:
        ValueError: a hash is not 16 bytes, the shape is not 5 dims, a name is too long.
    """
    if len(meta.block_hash) != HASH_BYTES or len(meta.parent_hash) != HASH_BYTES:
        raise ValueError("hashes must be 16 bytes")
    if len(meta.shape) != 5 or len(meta.token_bytes) % 4:
        raise ValueError("bad shape or token bytes")
    head = _HEAD.pack(MAGIC, RECORD_FORMAT_VERSION, len(meta.token_bytes) // 4, meta.block_hash,
                      meta.parent_hash, _pad(meta.codec, 8, "codec"), _pad(meta.dtype, 12, "dtype"),
                      *meta.shape, meta.payload_len, meta.payload_checksum)
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(meta.token_bytes)
    return head + _TAIL.pack(h.intdigest()) + meta.token_bytes


def encode_record(meta: RecordMeta, payload) -> bytes:
    """The whole record as bytes (header, tokens, payload).

    Raises:
        ValueError: as :func:`encode_header`, or ``len(payload) != meta.payload_len``.
    """
    payload = memoryview(payload).cast("B")
    if len(payload) != meta.payload_len:
        raise ValueError(f"payload has {len(payload)} bytes, header says {meta.payload_len}")
    return encode_header(meta) + payload.tobytes()


def parse_header(buf, token_buf=None) -> RecordMeta:
    """Parse and check a record header.

    Args:
        buf: at least ``HEADER_BYTES`` bytes starting at the record; when
            ``token_buf`` is None it must also hold the token bytes after them.
        token_buf: the token bytes, when read separately.

    Returns:
        the record's metadata (payload not checked; see :func:`verify_payload`).

    Raises:
        RecordError: too short, bad magic, unknown version, or header checksum mismatch.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES:
        raise RecordError(f"truncated record header ({len(mv)} of {HEADER_BYTES} bytes)")
    fields = _HEAD.unpack_from(mv, 0)
    magic, version, ntok, bh, ph, codec, dtype = fields[:7]
    shape = tuple(fields[7:12])
    payload_len, payload_sum = fields[12:14]
    if magic != MAGIC:
        raise RecordError("bad record magic")
    if version != RECORD_FORMAT_VERSION:
        raise RecordError(f"unsupported record format version {version}")
    (head_sum,) = _TAIL.unpack_from(mv, _HEAD.size)
    if token_buf is None:
        tokens = bytes(mv[HEADER_BYTES:HEADER_BYTES + 4 * ntok])
    else:
        tokens = bytes(token_buf)
    if len(tokens) != 4 * ntok:
        raise RecordError("truncated record tokens")
    h = xxhash.xxh3_64()
    h.update(mv[: _HEAD.size])
    h.update(tokens)
    if h.intdigest() != head_sum:
        raise RecordError("record header checksum mismatch")
    try:
        codec_s = codec.rstrip(b"\0").decode("ascii")
        dtype_s = dtype.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise RecordError("record names are not ASCII") from None
    return RecordMeta(bh, ph, tokens, codec_s, dtype_s, shape, payload_len, payload_sum)


def verify_payload(meta: RecordMeta, payload) -> None:
    """Raise :class:`RecordError` unless ``payload`` has the length and checksum ``meta`` records."""
    mv = memoryview(payload).cast("B")
    if len(mv) != meta.payload_len:
        raise RecordError(f"payload has {len(mv)} bytes, expected {meta.payload_len}")
    if checksum(mv) != meta.payload_checksum:
        raise RecordError("payload checksum mismatch")


def decode_record(data) -> tuple[RecordMeta, memoryview]:
    """Parse a whole record (:func:`encode_record`'s output) and verify its payload.

    Returns:
        ``(meta, payload)``, the payload a view into ``data``.

    Raises:
        RecordError: any check fails, or ``data`` has bytes beyond the record.
    """
    mv = memoryview(data).cast("B")
    meta = parse_header(mv)
    start = HEADER_BYTES + len(meta.token_bytes)
    if len(mv) != start + meta.payload_len:
        raise RecordError(f"record is {len(mv)} bytes, header says {start + meta.payload_len}")
    payload = mv[start:]
    verify_payload(meta, payload)
    return meta, payload
