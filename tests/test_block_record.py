"""Block records: round trip, and every kind of damage or mismatch is refused."""
from __future__ import annotations

import os

import pytest

from kvmesh.cache_store.block_record import (
    HEADER_BYTES,
    ZERO_HASH,
    RecordError,
    RecordMeta,
    checksum,
    decode_record,
    encode_record,
    parse_header,
)
from kvmesh.cache_store.hashing import Namespace, hash_blocks

SHAPE = (4, 2, 2, 16, 64)
ROOT = Namespace("m").root_hash()


def chain(n=3, root=ROOT, seed=0):
    import random

    rng = random.Random(seed)
    return hash_blocks([rng.randrange(256) for _ in range(16 * n)], 16, root)


def record(bh, i, payload=None, codec="none", dtype="float32", shape=SHAPE):
    payload = payload if payload is not None else os.urandom(64)
    parent = bh.hashes[i - 1] if i else ZERO_HASH
    meta = RecordMeta(bh.hashes[i], parent, bh.block_tokens(i), codec, dtype, shape, len(payload), checksum(payload))
    return meta, payload


def test_roundtrip():
    bh = chain()
    meta, payload = record(bh, 1)
    data = encode_record(meta, payload)
    assert len(data) == meta.record_len == HEADER_BYTES + 64 + 64
    got, p = decode_record(data)
    assert got == meta and bytes(p) == payload
    assert got.parent == bh.hashes[0] and record(bh, 0)[0].parent is None
    got.verify_for(bh.hashes[1], bh.hashes[0], bh.block_tokens(1), ROOT, "float32", SHAPE)


@pytest.mark.parametrize("where,needle", [
    ("payload", "payload checksum"),
    ("tokens", "header checksum"),
    ("hash", "header checksum"),
    ("magic", "magic"),
])
def test_any_flipped_byte_is_detected(where, needle):
    bh = chain()
    meta, payload = record(bh, 2)
    data = bytearray(encode_record(meta, payload))
    pos = {"payload": len(data) - 5, "tokens": HEADER_BYTES + 3, "hash": 10, "magic": 0}[where]
    data[pos] ^= 0x40
    with pytest.raises(RecordError, match=needle):
        decode_record(bytes(data))


def test_truncation_and_trailing_bytes_are_detected():
    meta, payload = record(chain(), 0)
    data = encode_record(meta, payload)
    for cut in (10, HEADER_BYTES + 10, len(data) - 1):
        with pytest.raises(RecordError):
            decode_record(data[:cut])
    with pytest.raises(RecordError, match="header says"):
        decode_record(data + b"x")
    with pytest.raises(RecordError, match="truncated record header"):
        parse_header(data[:HEADER_BYTES - 1])


def test_verify_for_checks_chain_tokens_namespace_and_layout():
    bh = chain()
    meta, _ = record(bh, 1)
    ok = dict(block_hash=bh.hashes[1], parent=bh.hashes[0], token_bytes=bh.block_tokens(1), root=ROOT,
              dtype="float32", shape=SHAPE)
    meta.verify_for(**ok)
    for change, needle in [
        (dict(block_hash=bh.hashes[2]), "block hash"),
        (dict(parent=bh.hashes[2]), "parent"),
        (dict(token_bytes=bh.block_tokens(2)), "token"),
        (dict(dtype="bfloat16"), "layout"),
        (dict(shape=(4, 2, 2, 32, 64)), "layout"),
    ]:
        with pytest.raises(RecordError, match=needle):
            meta.verify_for(**{**ok, **change})
    with pytest.raises(RecordError, match="codec"):
        record(bh, 1, codec="zstd")[0].verify_for(**ok)


def test_block0_from_another_namespace_fails_recomputation():
    """A block-0 record whose hash, parent and tokens all look right is still refused under
    another namespace root: its hash does not recompute from that root."""
    bh = chain()
    meta, _ = record(bh, 0)
    meta.verify_for(bh.hashes[0], None, bh.block_tokens(0), ROOT, "float32", SHAPE)
    other = Namespace("m", cache_salt="tenant-b").root_hash()
    with pytest.raises(RecordError, match="recompute"):
        meta.verify_for(bh.hashes[0], None, bh.block_tokens(0), other, "float32", SHAPE)


def test_forged_hash_fails_recomputation():
    """A record claiming a hash that its parent and tokens do not produce is refused."""
    bh, other = chain(seed=1), chain(seed=2)
    meta, payload = record(bh, 1)
    forged = RecordMeta(other.hashes[1], bh.hashes[0], bh.block_tokens(1), "none", "float32", SHAPE,
                        len(payload), checksum(payload))
    with pytest.raises(RecordError, match="recompute"):
        forged.verify_for(other.hashes[1], bh.hashes[0], bh.block_tokens(1), ROOT, "float32", SHAPE)
