"""vLLM's KV events, read from its ZMQ publisher and applied to a `ClusterIndex`.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'`` publishes every engine step's KV
cache changes on a ZMQ PUB socket (``vllm/distributed/kv_events.py``, vLLM 0.32):

* each message has three frames: ``topic`` (bytes, ``""`` by default), ``seq`` (8-byte
  big-endian counter from 0, per publisher process) and ``payload``;
* ``payload`` is msgpack of an ``EventBatch``: ``[ts, [event, ...], data_parallel_rank?]``
  (``ts`` seconds since the epoch);
* each event is a msgpack map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ``lora_name``,
  ``extra_keys``, ...), ``BlockRemoved`` (``block_hashes``, ``medium``) or
  ``AllBlocksCleared``. Older releases encoded events as tagged arrays
  (``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``); both forms
  are read.

:func:`decode_vllm_batch` turns one payload into kvmesh's `cache_store.events` form (hashes
as index keys, see `services.vllm_compat.event_key`; media ``GPU``/``CPU``/``STORAGE`` as
``device``/``host``/``disk``). :class:`VllmEventSubscriber` reads one server's socket with
pyzmq's asyncio API and feeds the index, numbering batches itself so the index's gap check
holds; a jump in vLLM's own ``seq`` is counted (``gaps``) and, when the server also has a
``replay_endpoint``, the missed batches are requested from it. A ``seq`` that goes
backwards means the server restarted and lost its cache: its entries are dropped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgpack

from kvmesh.cache_store.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.vllm_compat import event_key

__all__ = ["MEDIUM_MAP", "VllmBatch", "decode_vllm_batch", "VllmEventSubscriber"]

log = logging.getLogger(__name__)

#: vLLM medium names -> kvmesh media (None: vLLM's GPU pool).
MEDIUM_MAP = {None: "device", "GPU": "device", "CPU": "host", "STORAGE": "disk", "DISK": "disk"}

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


@dataclass(slots=True)
class VllmBatch:
    """One decoded vLLM event batch.

    Attributes:
        ts: publication time (seconds since the epoch).
        events: kvmesh events, hashes as index keys.
        root_blocks: ``(key, token_ids, extra_keys)`` of stored blocks without a parent,
            which a subscriber can re-hash to check the router's hash settings.
        block_sizes: distinct ``block_size`` values of the stored events (tokens).
    """

    ts: float
    events: list = field(default_factory=list)
    root_blocks: list = field(default_factory=list)
    block_sizes: set = field(default_factory=set)


def _medium(name) -> str:
    if isinstance(name, bytes):
        name = name.decode()
    m = MEDIUM_MAP.get(name)
    if m is None:
        raise ValueError(f"unknown vLLM KV event medium {name!r:.40}")
    return m


def _as_map(ev, fields: tuple[str, ...]) -> tuple[str, dict]:
    if isinstance(ev, dict):
        kind = ev.get("type")
        return kind, ev
    if isinstance(ev, (list, tuple)) and ev:
        return ev[0], dict(zip(fields, ev[1:]))
    raise ValueError(f"not a vLLM KV event: {ev!r:.80}")


def decode_vllm_batch(payload: bytes) -> VllmBatch:
    """Decode one vLLM ``EventBatch`` payload (msgpack).

    Events of other kinds than the three KV events are skipped; unknown fields ignored.

    Raises:
        ValueError: the payload is not a vLLM event batch, or an event is malformed
            (bad hash, unknown medium).
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types
        raise ValueError(f"KV event payload is not msgpack: {exc}") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError(f"not a vLLM EventBatch: {obj!r:.80}")
    out = VllmBatch(ts=float(obj[0]))
    for raw in obj[1]:
        kind = raw.get("type") if isinstance(raw, dict) else (raw[0] if raw else None)
        if kind == "BlockStored":
            _, ev = _as_map(raw, _STORED_FIELDS)
            keys = [event_key(h) for h in ev.get("block_hashes") or []]
            if not keys:
                continue
            parent = ev.get("parent_block_hash")
            medium = _medium(ev.get("medium"))
            bs = int(ev.get("block_size") or 0)
            tokens = list(ev.get("token_ids") or [])
            out.block_sizes.add(bs)
            out.events.append(BlockStored(keys, None if parent is None else event_key(parent), tokens, bs, medium))
            if parent is None and bs and len(tokens) >= bs:
                extra = ev.get("extra_keys")
                out.root_blocks.append((keys[0], tokens[:bs], extra[0] if extra else None))
        elif kind == "BlockRemoved":
            _, ev = _as_map(raw, _REMOVED_FIELDS)
            keys = [event_key(h) for h in ev.get("block_hashes") or []]
            if keys:
                out.events.append(BlockRemoved(keys, _medium(ev.get("medium"))))
        elif kind == "AllBlocksCleared":
            out.events.append(AllBlocksCleared())
    return out


class VllmEventSubscriber:
    """Reads one vLLM server's KV events into a shared `ClusterIndex`.

    Args:
        index: the router's index (used from this event loop only).
        worker_id: the server's name in the index.
        endpoint: the server's ZMQ publisher, e.g. ``tcp://10.0.0.5:5557``.
        replay_endpoint: its ZMQ replay (ROUTER) socket, or None.
        topic: the publisher's topic (vLLM's ``topic``, default empty).
        check_root: called with each parent-less stored block
            ``(key, token_ids, extra_keys)``; returns False when the router's hash
            settings do not reproduce that key (counted in ``hash_mismatches``).
        on_batch: called with each applied `EventBatch` (metrics: event lag).

    ``error`` says why reading stopped when the task failed (logged once), else ``""``.

    Counters (read by metrics and tests): ``batches``, ``events``, ``gaps``, ``restarts``,
    ``decode_errors``, ``hash_checks``, ``hash_mismatches``, ``last_lag_s`` (seconds from
    a batch's ``ts`` to its apply), ``block_sizes`` seen.
    """

    def __init__(self, index: ClusterIndex, worker_id: str, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", check_root=None, on_batch=None):
        self.index = index
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.check_root = check_root
        self.on_batch = on_batch
        self._local_seq = 0
        self._last_vllm_seq: int | None = None
        self._task: asyncio.Task | None = None
        self._ctx = None
        self.batches = self.events = self.gaps = self.restarts = self.decode_errors = 0
        self.hash_checks = self.hash_mismatches = 0
        self.last_lag_s = 0.0
        self.block_sizes: set[int] = set()
        self.connected = asyncio.Event()
        self.error = ""  # why the reading task ended, when it failed

    # ----------------------------------------------------------------- apply
    def apply(self, seq: int, payload: bytes, now_wall: float | None = None) -> bool:
        """Apply one message (vLLM ``seq``, payload) to the index.

        Returns:
            True when applied; False when it could not be decoded (counted in
            ``decode_errors``, logged).
        """
        last = self._last_vllm_seq
        if last is not None and seq <= last:
            # vLLM's PUB socket never repeats a seq and replays are applied only in order,
            # so a counter going back means the server restarted with an empty cache
            self.restarts += 1
            log.warning("vLLM server %s restarted (KV event seq %d after %d): dropping its index entries",
                        self.worker_id, seq, last)
            self._clear()
        elif last is not None and seq > last + 1:
            self.gaps += 1
            log.warning("vLLM server %s: missed KV event batches %d..%d", self.worker_id, last + 1, seq - 1)
        try:
            batch = decode_vllm_batch(payload)
        except ValueError as exc:
            self.decode_errors += 1
            log.error("vLLM server %s: bad KV event batch %d: %s", self.worker_id, seq, exc)
            self._last_vllm_seq = seq
            return False
        self._last_vllm_seq = seq
        self.block_sizes |= batch.block_sizes
        if self.check_root is not None:
            for root in batch.root_blocks:
                self.hash_checks += 1
                if not self.check_root(*root):
                    self.hash_mismatches += 1
                    if self.hash_mismatches == 1:
                        log.error("vLLM server %s publishes block hashes kvmesh does not reproduce: check that "
                                  "--vllm-hash-algo, --vllm-hash-seed (the server's PYTHONHASHSEED) and "
                                  "--vllm-block-size match the server; routing to it by prefix will miss",
                                  self.worker_id)
        self._local_seq += 1
        applied = EventBatch(self.worker_id, self._local_seq, batch.ts, batch.events)
        self.index.apply_batch(applied)
        if self.on_batch is not None:
            self.on_batch(applied)
        self.batches += 1
        self.events += len(batch.events)
        self.last_lag_s = max(0.0, (now_wall if now_wall is not None else time.time()) - batch.ts)
        return True

    def _clear(self) -> None:
        self._local_seq += 1
        self.index.apply_batch(EventBatch(self.worker_id, self._local_seq, time.time(), [AllBlocksCleared()]))

    # ------------------------------------------------------------------- I/O
    def start(self) -> asyncio.Task:
        """Connect and start reading (a task on the running loop). Idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"vllm-events-{self.worker_id}")
        return self._task

    async def stop(self) -> None:
        """Stop reading and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _run(self) -> None:
        # nothing awaits this task while the router runs: a failure that ends it is logged
        # here and kept in ``error`` (the router's /health shows it), not left in the task
        try:
            await self._read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = f"KV event subscriber for {self.endpoint} stopped: {type(exc).__name__}: {exc}"
            log.error("vLLM server %s: %s; routing to it uses load only", self.worker_id, self.error)

    async def _read(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self.connected.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.decode_errors += 1
                    continue
                _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                last = self._last_vllm_seq
                if self.replay_endpoint and last is not None and seq > last + 1:
                    await self._replay(ctx, last + 1, seq)
                self.apply(seq, payload)
        finally:
            sub.close(0)
            ctx.term()

    async def _replay(self, ctx, start: int, stop: int) -> None:
        """Ask the replay socket for batches ``start..stop-1`` and apply what it still has."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(2000):
                    log.warning("vLLM server %s: no answer from replay endpoint %s", self.worker_id,
                                self.replay_endpoint)
                    return
                frames = await sock.recv_multipart()
                if len(frames) < 4 or not frames[-1]:
                    return  # end marker
                seq = int.from_bytes(frames[-2], "big")
                if seq >= stop:
                    continue
                if self._last_vllm_seq is not None and seq == self._last_vllm_seq + 1:
                    self.apply(seq, frames[-1])
        finally:
            sock.close(0)
