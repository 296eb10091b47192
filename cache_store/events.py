"""KV cache events a worker publishes so routers can track what it caches.

The event kinds and their fields are shaped after vLLM's KV events
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in
``vllm/distributed/kv_events.py``). The wire format is msgpack (msgpack spec;
msgpack-python 1.x, ``use_bin_type=True``) with every object a tagged array:

* batch:   ``["EventBatch", worker_id: str, seq: int, ts: float, [event, ...]]``
* stored:  ``["BlockStored", [hash: bin16, ...], parent: bin16 | nil,
  [token_id: int, ...], block_size: int, medium: str]``
* removed: ``["BlockRemoved", [hash: bin16, ...], medium: str]``
* cleared: ``["AllBlocksCleared"]``

Hashes are the 16-byte block hashes of :mod:`cache_store.hashing`.
``token_ids`` of a ``BlockStored`` holds exactly ``block_size`` ids per stored
block, in block order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import msgpack

from kvmesh.cache_store.hashing import HASH_BYTES

__all__ = [
    "MEDIUMS",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "EventBatch",
    "encode_batch",
    "decode_batch",
]

MEDIUMS = ("device", "host", "disk", "peer", "remote")

_TOKEN_LIMIT = 1 << 32


@dataclass(slots=True)
class BlockStored:
    """Blocks newly cached on a worker, as one chain.

    Attributes:
        block_hashes: 16-byte hashes, parent-first; block ``k + 1``'s parent
            is block ``k``.
        parent_block_hash: hash of the block before ``block_hashes[0]``;
            None when the first block starts a sequence.
        token_ids: ``block_size * len(block_hashes)`` token ids.
        block_size: tokens per block.
        medium: where the blocks live, one of ``MEDIUMS``.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = "device"


@dataclass(slots=True)
class BlockRemoved:
    """Blocks a worker no longer caches on ``medium``."""

    block_hashes: list[bytes]
    medium: str = "device"


@dataclass(slots=True)
class AllBlocksCleared:
    """The worker dropped every cached block."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class EventBatch:
    """Events from one worker, in order.

    Attributes:
        worker_id: publishing worker.
        seq: batch sequence number, >= 0, increasing per worker (a gap tells
            a subscriber it missed batches).
        ts: wall-clock time of publication, seconds since the epoch.
        events: the events, oldest first.
    """

    worker_id: str
    seq: int
    ts: float
    events: list


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_hash(h: object, what: str) -> None:
    if not isinstance(h, bytes) or len(h) != HASH_BYTES:
        raise ValueError(f"{what} must be {HASH_BYTES} bytes, got {h!r:.60}")


def _check_event(ev: object) -> None:
    if isinstance(ev, BlockStored):
        if not isinstance(ev.block_hashes, list) or not ev.block_hashes:
            raise ValueError("BlockStored.block_hashes must be a non-empty list")
        for h in ev.block_hashes:
            _check_hash(h, "block hash")
        if ev.parent_block_hash is not None:
            _check_hash(ev.parent_block_hash, "parent_block_hash")
        if not _is_int(ev.block_size) or ev.block_size < 1:
            raise ValueError("BlockStored.block_size must be a positive int")
        if not isinstance(ev.token_ids, list):
            raise ValueError("BlockStored.token_ids must be a list")
        if len(ev.token_ids) != ev.block_size * len(ev.block_hashes):
            raise ValueError(
                f"BlockStored has {len(ev.token_ids)} token ids for "
                f"{len(ev.block_hashes)} blocks of {ev.block_size}"
            )
        toks = ev.token_ids
        if not all(type(t) is int for t in toks):
            raise ValueError("BlockStored.token_ids must be ints")
        if min(toks) < 0 or max(toks) >= _TOKEN_LIMIT:
            raise ValueError("BlockStored token ids must lie in [0, 2**32)")
        if ev.medium not in MEDIUMS:
            raise ValueError(f"unknown medium {ev.medium!r:.40}")
    elif isinstance(ev, BlockRemoved):
        if not isinstance(ev.block_hashes, list) or not ev.block_hashes:
            raise ValueError("BlockRemoved.block_hashes must be a non-empty list")
        for h in ev.block_hashes:
            _check_hash(h, "block hash")
        if ev.medium not in MEDIUMS:
            raise ValueError(f"unknown medium {ev.medium!r:.40}")
    elif not isinstance(ev, AllBlocksCleared):
        raise ValueError(f"not a KV event: {type(ev).__name__}")


def _check_batch(batch: EventBatch) -> None:
    if not isinstance(batch.worker_id, str) or not batch.worker_id:
        raise ValueError("EventBatch.worker_id must be a non-empty str")
    if not _is_int(batch.seq) or batch.seq < 0:
        raise ValueError("EventBatch.seq must be an int >= 0")
    if (
        not isinstance(batch.ts, (int, float))
        or isinstance(batch.ts, bool)
        or not math.isfinite(batch.ts)
    ):
        raise ValueError("EventBatch.ts must be a finite number")
    if not isinstance(batch.events, list):
        raise ValueError("EventBatch.events must be a list")
    for ev in batch.events:
        _check_event(ev)


def _event_to_wire(ev: KVEvent) -> list:
    if isinstance(ev, BlockStored):
        return [
            "BlockStored",
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.medium,
        ]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: EventBatch) -> bytes:
    """Serialize a batch to msgpack bytes (format in the module docstring).

    Raises:
        ValueError: the batch or one of its events violates the format
            (wrong types, hashes not 16 bytes, token count not
            ``block_size`` per block, unknown medium, ...).
    """
    _check_batch(batch)
    wire = [
        "EventBatch",
        batch.worker_id,
        batch.seq,
        float(batch.ts),
        [_event_to_wire(ev) for ev in batch.events],
    ]
    return msgpack.packb(wire, use_bin_type=True)


def _event_from_wire(obj: object) -> KVEvent:
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise ValueError("event must be a tagged array")
    tag = obj[0]
    if tag == "BlockStored":
        if len(obj) != 6:
            raise ValueError("BlockStored must have 5 fields")
        ev: KVEvent = BlockStored(obj[1], obj[2], obj[3], obj[4], obj[5])
    elif tag == "BlockRemoved":
        if len(obj) != 3:
            raise ValueError("BlockRemoved must have 2 fields")
        ev = BlockRemoved(obj[1], obj[2])
    elif tag == "AllBlocksCleared":
        if len(obj) != 1:
            raise ValueError("AllBlocksCleared has no fields")
        ev = AllBlocksCleared()
    else:
        raise ValueError(f"unknown event tag {tag!r:.40}")
    return ev


def decode_batch(data: bytes) -> EventBatch:
    """Parse msgpack bytes written by :func:`encode_batch`.

    Raises:
        ValueError: ``data`` is not valid msgpack, has trailing bytes, or does
            not follow the format (unknown tag, wrong arity or types, hashes
            not 16 bytes, ...).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError("event batch must be bytes")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed msgpack: {exc}") from None
    if not isinstance(obj, list) or len(obj) != 5 or obj[0] != "EventBatch":
        raise ValueError("not an EventBatch tagged array")
    if not isinstance(obj[4], list):
        raise ValueError("EventBatch.events must be an array")
    batch = EventBatch(obj[1], obj[2], obj[3], [_event_from_wire(e) for e in obj[4]])
    _check_batch(batch)
    batch.ts = float(batch.ts)
    return batch
