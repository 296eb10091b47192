"""The tiers below a worker's device pool: host memory, disk, peer staging and the shared remote tier.

:class:`TierStore` moves KV blocks between the device pool tensor and the
lower tiers and keeps their indexes:

* **Offload.** When the device pool evicts cached blocks
  (``PrefixCache(on_offload=store.offload)``), their KV is copied into the
  host tier in one batched copy before the pool hands the blocks out. The
  host tier is inclusive: a block already there is only touched.
* **Disk.** In ``write_mode="through"`` (the default) every block entering
  the host tier is queued for disk at once; in ``"back"`` a block is queued
  only when the host tier evicts it. A writer thread turns the queue into
  segment files (:mod:`cache_store.disk_tier`); while queued, the block's host
  slot is pinned so its bytes stay put. The queue is bounded
  (``max_pending_write_bytes``): past it, writes are skipped, never waited for.
* **Locate and load.** For the blocks after a request's device hit the
  scheduler calls :meth:`locate` (host, then peer staging, then disk; each
  candidate's hash, parent, tokens and layout are verified against the
  request's chain, see ``block_record.RecordMeta.verify_for``), allocates
  device blocks and calls :meth:`load`, which copies the KV in (disk payloads
  are checksummed) and stops at the first block that fails.
* **Remote.** With ``remote_bytes`` the blocks entering the host tier are
  also queued for the cluster's shared remote tier in Redis
  (:mod:`cache_store.remote_tier`); a second writer thread sends them in
  batches.
* **Prefetch.** Before a request is submitted, :meth:`TierStore.prefetch`
  (in the submitter's thread) reads what only the disk holds of the prompt,
  then the remote tier's run after the local tiers', verifies every record,
  and stages it; scheduling then loads it from the staging area and waits
  neither for the disk nor for Redis (it still reads the disk itself for
  whatever was not prefetched).
* **Events.** Host and disk changes are reported as ``BlockStored`` /
  ``BlockRemoved`` with ``medium="host"`` / ``"disk"``; blocks found on disk
  at start are advertised, except those this worker would not load (another
  layout, or a codec outside ``accepted_codecs``), which are not indexed
  (``disk_tier``: foreign segments).
* **Stop.** :meth:`close` writes the host tier's blocks that have no disk copy
  (in write-back mode, every block not yet evicted from it; in write-through,
  those whose write was skipped), then finishes queued writes, within its
  timeout.

Lookup sources register by kind in :data:`SOURCES`, in lookup order; adding a
tier means registering a source, not adding a branch.

Thread-safety: every method takes the store's lock (a re-entrant lock; the
writer threads take it only to pick up jobs and to index a finished segment).
:meth:`TierStore.prefetch` does its disk and Redis reads without it, in the
submitter's thread; what it did not stage is read from disk by :meth:`load`
under the lock on the engine thread, delaying that step (see docs/TIERS.md).
"""

from __future__ import annotations

import errno
import itertools
import logging
import operator
import os
import shutil
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvmesh.cache_store.block_record import (
    HEADER_BYTES,
    ZERO_HASH,
    RecordError,
    RecordMeta,
    checksum,
    dtype_name,
    host_meta,
)
from kvmesh.cache_store.disk_tier import DiskEntry, DiskTier, SegmentReadError
from kvmesh.cache_store.events import BlockRemoved, BlockStored
from kvmesh.cache_store.fresh_thread import run_on_fresh_thread
from kvmesh.cache_store.host_tier import HostTier
from kvmesh.cache_store.kv_codec import CODECS, KVCodec, codec_of_rank, loss_rank, make_codec
from kvmesh.cache_store.prefix_cache import EvictedBlock
from kvmesh.cache_store.remote_tier import RemoteTier, record_key_id
from kvmesh.cache_store.tier_config import WRITE_MODES, TierConfig, staging_must_fit

__all__ = ["WRITE_MODES", "TierConfig", "TierStore", "Located", "SOURCES"]

log = logging.getLogger(__name__)

class WallClock:
    """`TierStore.clock` on the host: a load's wall time, reported at once."""

    @staticmethod
    def start() -> float:
        return time.perf_counter()

    @staticmethod
    def stop(started: float, done: Callable[[float, float], None]) -> None:
        done(time.perf_counter() - started, time.monotonic())

    @staticmethod
    def poll() -> None:
        pass


@dataclass(slots=True, eq=False)
class Located:
    """A block found in a lower tier for one position of a request's chain."""

    source: "_Source"
    handle: object
    medium: str


@dataclass(slots=True, frozen=True)
class _Staged:
    """The identity a staging-area entry keeps: the record's, plus the tenant it was read for
    (``owner``, what `host_tier.HostTier` evicts fairly by)."""

    block_hash: bytes
    parent_hash: bytes
    token_bytes: bytes
    owner: object = None


class CodecNotAccepted(RecordError):
    """A sound record in a codec this worker's tiers do not accept (`TierStore.check_codec`)."""


@dataclass(slots=True, eq=False)
class _WriteJob:
    block_hash: bytes
    parent_hash: bytes
    token_bytes: bytes
    slot: int
    ready: object
    generation: int
    nbytes: int
    owner: object = None  # the block's tenant (`EvictedBlock.owner`)


class _Source:
    """A tier as the lookup sees it. Subclasses implement the three methods."""

    kind = ""

    def find(self, block_hash: bytes) -> tuple[object, str, RecordMeta] | None:
        """``(handle, medium credited, metadata to verify)`` for a held block, else None."""
        raise NotImplementedError

    def load(self, handles: list, block_ids: list[int]) -> int:
        """Copy ``handles``' KV into pool rows ``block_ids``; returns how many leading ones succeeded."""
        raise NotImplementedError

    def release(self, handles: list) -> None:
        """Undo what :meth:`find` holds (pins) for handles that will not be loaded."""

    def loss_ranks(self, handles: list) -> list[int]:
        """The loss rank (`kv_codec.loss_rank`) of each handle's KV once loaded."""
        raise NotImplementedError


class TierStore:
    """Host, disk and peer-staging tiers of one worker, fed from its device pool.

    Args:
        kv_cache: the device pool ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``.
        config: tier sizes and codecs (validated here).
        event_sink: receives ``BlockStored`` / ``BlockRemoved`` for the host
            and disk media (called under the store's lock, possibly from the
            writer thread).

    Raises:
        ValueError: invalid ``config``.
        OSError: the disk directory cannot be created.
    """

    def __init__(self, kv_cache: torch.Tensor, config: TierConfig, event_sink: Callable[[object], None] | None = None):
        config.validate()
        self.config = config
        self.kv_cache = kv_cache
        self.block_shape = tuple(kv_cache.shape[1:])
        self.block_size = self.block_shape[3]
        self.dtype = kv_cache.dtype
        self.dtype_name = dtype_name(kv_cache.dtype)
        self._sink = event_sink
        self.lock = threading.RLock()
        self._codecs: dict[str, KVCodec] = {}
        #: codecs of the records this pool loads: exact KV, and the lossy codecs this worker's
        #: own tier flags accept. A block another worker wrote to the shared remote tier (or
        #: a peer exported) in another codec is a miss: it would change this worker's outputs.
        self.accepted_codecs = frozenset({"none", config.host_codec, config.disk_codec, config.remote_codec})
        #: per device-pool row, the loss rank (`kv_codec.loss_rank`) of the KV it holds: set
        #: when a block is loaded from a tier or record, and when the row is computed
        #: (`mark_computed`: 0, or the rank of the lossy context it is computed over).
        #: Offloads and exports carry it on, so a block decoded from a lossy codec, or computed
        #: over one, is never passed on as exact (records are labelled and stored in the
        #: lossiest codec the KV went through).
        self.row_loss = bytearray(kv_cache.shape[0])
        #: per source kind ("host", "peer", "disk"), an EWMA of the wall seconds one block
        #: took to load into the pool (read, verify, decode, copy); "disk" and "remote" also
        #: from the prefetch's reads into the staging area; unset until measured
        self.load_seconds_per_block: dict[str, float] = {}
        #: times each load: wall time here; the engine sets a clock that times a load's device
        #: copies and decodes by CUDA events on a GPU, where the call returns at their launch
        #: (`workers.engine.StepClock`: ``start()``, ``stop(started, done)``, ``poll()``)
        self.clock = WallClock()
        self._cuts: dict[tuple[str, str], int] = {}  # (stage, source) -> cuts so far (`_probe`)
        on_cuda = kv_cache.device.type == "cuda"
        #: `TierConfig.load_policy` with "auto" resolved for this pool's device
        self.load_policy = (config.load_policy if config.load_policy != "auto"
                            else "cost" if on_cuda else "always")
        self.host = (HostTier(config.host_bytes, self.codec(config.host_codec), pin_memory=on_cuda)
                     if config.host_bytes > 0 else None)
        self.peer = (HostTier(config.peer_bytes, self.codec("none"), pin_memory=on_cuda, medium="peer")
                     if config.peer_bytes > 0 else None)
        if self.peer is not None and self.peer.num_slots == 0:
            problem = (f"peer_bytes {config.peer_bytes} cannot hold one block "
                       f"({self.codec('none').payload_bytes} bytes)")
            if staging_must_fit(config.peer_bytes, config.remote_bytes):
                raise ValueError(f"{problem}: give at least that, or 0 for no staging area")
            log.warning("%s: no staging area (no peer fetch; disk blocks are read in scheduling); "
                        "give --peer-bytes at least one block to have one", problem)
            self.peer = None
        self.disk: DiskTier | None = None
        self.disk_codec = self.codec(config.disk_codec)
        self._generation = 0
        self._jobs: deque[_WriteJob] = deque()
        self._pending_bytes = 0
        self._writing = 0
        self._cv = threading.Condition(self.lock)
        self._stop = False
        self._writer: threading.Thread | None = None
        self.stats_counters = {"offloaded": 0, "offload_skipped": 0, "writes_skipped": 0, "write_errors": 0,
                               "segments_written": 0, "loaded": 0, "load_failures": 0,
                               "remote_puts_skipped": 0, "remote_put_errors": 0, "loads_not_worth_it": 0,
                               "fetches_not_worth_it": 0}
        # workers.grpc_guard imports nothing of kvmesh (no cycle); imported here, as in
        # remote_tier, so that importing cache_store does not load grpc
        from kvmesh.workers.grpc_guard import LogLimiter

        #: a failing disk (full, read-only, broken) fails every write: one ERROR line per
        #: failure would flood the log, so at most LOG_BURST per LOG_WINDOW_S, the rest counted
        #: in the next line; `write_errors` counts them all (disk_write_failures_total). Used
        #: by the disk writer thread only (a LogLimiter takes no lock)
        self._write_error_log = LogLimiter(log, "failed disk segment writes")
        self.remote: RemoteTier | None = None
        self.remote_codec = self.codec(config.remote_codec)
        self._rjobs: deque[_WriteJob] = deque()
        self._rpending_bytes = 0
        self._rwriting = 0
        self._remote_writer: threading.Thread | None = None
        if config.disk_dir:
            # blocks in a codec this worker would not load are not indexed, so never advertised
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, self.block_shape, self.dtype_name,
                                 segment_bytes=config.segment_bytes, fsync=config.fsync,
                                 codecs=self.accepted_codecs)
            self.disk.adopt_producer(config.producer)
            with self.lock:
                metas = self.disk.scan()
                self._emit_chains([m.block_hash for m in metas], [m.parent for m in metas],
                                  [m.token_bytes for m in metas], "disk")
            if self.disk.num_damaged or self.disk.num_torn:
                log.warning("disk tier %s: deleted %d damaged segment(s) and %d unfinished write(s) at start",
                            self.disk.directory, self.disk.num_damaged, self.disk.num_torn)
            try:
                room = self.disk.used_bytes + shutil.disk_usage(self.disk.directory).free
            except OSError:
                room = None
            if room is not None and room < self.disk.capacity_bytes:
                log.warning("disk tier %s: --disk-bytes is %d bytes but the filesystem has room for %d (free space "
                            "and this tier's segments); writes will fail once it is full, and the tier then holds "
                            "what fits", self.disk.directory, self.disk.capacity_bytes, room)
            self._io = ThreadPoolExecutor(self.IO_THREADS, thread_name_prefix="kvmesh-disk-io")
            self._writer = threading.Thread(target=self._write_loop, name="kvmesh-disk-writer", daemon=True)
            self._writer.start()
        try:
            self._start_remote(config)
        except BaseException:  # the disk folder's lock and writer thread are not left behind
            self.close()
            raise
        self.sources: list[_Source] = [src for make in SOURCES.values() if (src := make(self)) is not None]

    def _start_remote(self, config: TierConfig) -> None:
        if config.remote_bytes:
            record = HEADER_BYTES + 4 * self.block_size + self.remote_codec.payload_bytes
            if config.remote_bytes < record:
                raise ValueError(f"remote_bytes {config.remote_bytes} cannot hold one block record ({record} bytes "
                                 f"with codec {config.remote_codec!r}); give the remote tier at least that")
            self.remote = _connect_remote(config)
            self._remote_writer = threading.Thread(target=self._remote_loop, name="kvmesh-remote-writer",
                                                   daemon=True)
            self._remote_writer.start()

    # -- helpers -------------------------------------------------------------------------
    def codec(self, name: str) -> KVCodec:
        """The codec ``name`` for this pool's block shape and dtype (cached).

        Raises:
            ValueError: unknown codec.
        """
        c = self._codecs.get(name)
        if c is None:
            c = self._codecs[name] = make_codec(name, self.block_shape, self.dtype)
        return c

    def _emit_removed(self, hashes: list[bytes], medium: str) -> None:
        if self._sink is not None and hashes:
            self._sink(BlockRemoved(list(hashes), medium))

    #: Weight of the newest sample in ``load_seconds_per_block``.
    LOAD_COST_ALPHA = 0.25
    #: One in this many cuts of one source at one stage (`worth_loading`, `fetch_decision`)
    #: reads anyway: a fresh measurement.
    PROBE_EVERY = 16
    #: Reads of fewer blocks than this are not folded into the prefetch's per-block costs:
    #: their time is mostly the round trip or the seek, not the blocks.
    MIN_COST_SAMPLE_BLOCKS = 4

    def _probe(self, stage: str, kind: str) -> bool:
        """Count one cut of ``kind`` at ``stage`` ("load" or "fetch"); True when this one is
        the ``PROBE_EVERY``-th of that pair and should read anyway. Each (stage, source)
        pair counts on its own, so that a request cutting at both stages cannot keep every
        probe on one of them."""
        with self.lock:
            key = (stage, kind)
            n = self._cuts[key] = self._cuts.get(key, 0) + 1
            return n % self.PROBE_EVERY == 0

    def _note_load_cost(self, kind: str, seconds: float) -> None:
        old = self.load_seconds_per_block.get(kind)
        self.load_seconds_per_block[kind] = seconds if old is None else old + self.LOAD_COST_ALPHA * (seconds - old)

    def worth_loading(self, located: list[Located], compute_seconds_per_block: float | None) -> int:
        """How many leading blocks of ``located`` to load under ``load_policy``.

        ``"cost"``: up to the first block whose source has measured slower per block
        (``load_seconds_per_block``) than ``compute_seconds_per_block``, the worker's
        prefill time for one block's tokens; a source not measured yet, or no prefill
        estimate, loads. Every ``PROBE_EVERY``-th cut of a source is skipped, so that a tier
        that got faster (a warm page cache, a quieter disk) is measured again; except the
        disk where :meth:`prefetch` reads it (a staging area): its probes happen there, off
        the engine thread, never in scheduling. Cut blocks are counted in
        ``stats_counters["loads_not_worth_it"]``.
        """
        n = len(located)
        if self.load_policy != "cost" or not compute_seconds_per_block or not n:
            return n
        self.clock.poll()  # loads whose device work has finished since (engine thread, as `load`)
        costs = self.load_seconds_per_block
        for i, loc in enumerate(located):
            cost = costs.get(loc.source.kind)
            if cost is not None and cost > compute_seconds_per_block:
                kind = loc.source.kind
                if not (kind == "disk" and self.can_prefetch) and self._probe("load", kind):
                    return n
                with self.lock:
                    self.stats_counters["loads_not_worth_it"] += n - i
                return i
        return n

    def fetch_decision(self, kind: str, compute_seconds_per_block: float | None) -> str:
        """Whether :meth:`prefetch` reads from ``kind`` ("disk" or "remote") under
        ``load_policy``: "fetch", "cut" or "probe" (a cut source read anyway, to measure it
        again). Under ``"cost"`` a source that has measured slower per block (its read,
        verification and staging: ``load_seconds_per_block``) than
        ``compute_seconds_per_block`` is cut; as in :meth:`worth_loading`, an unmeasured
        source or no prefill estimate fetches, and every ``PROBE_EVERY``-th cut probes. Cuts
        are counted in ``stats_counters["fetches_not_worth_it"]``."""
        if self.load_policy != "cost" or not compute_seconds_per_block:
            return "fetch"
        cost = self.load_seconds_per_block.get(kind)
        if cost is None or cost <= compute_seconds_per_block:
            return "fetch"
        if self._probe("fetch", kind):
            return "probe"
        with self.lock:
            self.stats_counters["fetches_not_worth_it"] += 1
        return "cut"

    def mark_computed(self, block_ids: Sequence[int], context_loss: int = 0) -> None:
        """Pool rows ``block_ids`` are about to hold KV computed here: see ``row_loss``.

        Args:
            block_ids: the pool rows.
            context_loss: the loss rank (`kv_codec.loss_rank`) of the KV they are computed
                over (the request's cached prefix): KV computed here over KV decoded from a
                lossy codec differs from a cold run's as that KV does, so it is labelled
                with that rank, whatever the rows held before (0: exact).
        """
        row_loss = self.row_loss
        for b in block_ids:
            row_loss[b] = context_loss

    def _slot_record(self, slot: int, codec: KVCodec) -> tuple[KVCodec, object]:
        """``(codec, payload)`` of a record of host ``slot`` for a tier whose codec is ``codec``:
        stored and labelled in the lossiest of ``codec``, the host tier's and the KV's history,
        so lossy KV is never labelled exact. The payload is a view of the slot when no
        transcoding is needed."""
        host = self.host
        rank = max(host.loss_rank(slot), codec.loss_rank)
        c = codec if rank == codec.loss_rank else self.codec(codec_of_rank(rank))
        if c.name == host.codec.name:
            return c, host.payload_bytes_view(slot)
        return c, self._transcode(host.codec, host.payload(slot), c)

    @property
    def can_offload(self) -> bool:
        return self.host is not None

    # -- offload (engine thread, inside PrefixCache.allocate) ------------------------------
    def offload(self, evicted: list[EvictedBlock]) -> None:
        """Copy evicted device blocks into the host tier (and queue disk writes).

        Called with the pool rows still holding the blocks' KV. Blocks already
        in the host tier are touched instead. When every host slot is pinned
        the remaining blocks are skipped (they are simply not cached below).
        """
        host = self.host
        if host is None or not evicted:
            return
        with self.lock:
            # The pool evicts chain tails first; reversed, each chain runs parent first, so its
            # blocks get ascending host slots and adjacent disk records (one copy / read per run).
            held_here = host.entries
            fresh = evicted[::-1]
            if not held_here.keys().isdisjoint(map(_hash_of, fresh)):
                fresh = [ev for ev in fresh if ev.block_hash not in held_here]
                for ev in evicted:
                    if ev.block_hash in held_here:
                        host.touch(ev.block_hash)
            if not fresh:
                return
            back = self.disk is not None and self.config.write_mode == "back"
            slots, dropped, held = host.reserve(len(fresh), hold=self._wants_disk if back else None,
                                                incoming=Counter(ev.owner for ev in fresh))
            if dropped:
                self._emit_removed(dropped, "host")
            for slot in held:  # write-back: evicted from host, written to disk from its pinned slot
                self._queue_write(slot, already_pinned=True)
            if len(slots) < len(fresh):
                self.stats_counters["offload_skipped"] += len(fresh) - len(slots)
                fresh = fresh[:len(slots)]
            if not fresh:
                return
            block_ids, hashes, parents, tokens, _ = zip(*fresh)  # columns, built once
            ready = host.store(self.kv_cache, block_ids, slots)
            # checked: fresh holds distinct hashes (the pool's) that are not in the host tier
            row_loss = self.row_loss
            loss = [row_loss[b] for b in block_ids]
            loss = loss if any(loss) else None
            host.insert_many(fresh, slots, ready, hashes=hashes, checked=True, loss=loss)
            self._emit_chains(hashes, parents, tokens, "host")
            if self.disk is not None and self.config.write_mode == "through":
                self._queue_writes(slots, fresh, ready)
            if self.remote is not None:
                self._queue_remote(slots, fresh, ready)
            self.stats_counters["offloaded"] += len(fresh)

    def _emit_chains(self, hashes: Sequence[bytes], parents: Sequence[bytes | None], tokens: Sequence[bytes],
                     medium: str) -> None:
        """One ``BlockStored`` per run of blocks where each is the previous one's child.

        Args:
            hashes, parents, tokens: per block, in order: its hash, its parent's
                hash (None for block 0) and its token ids as little-endian uint32.
        """
        if self._sink is None or not hashes:
            return
        n = len(hashes)
        # run starts: block 0 and every block whose parent is not the block before it
        starts = [0, *itertools.compress(range(1, n), map(operator.ne, parents[1:], hashes[:-1]))]
        toks = np.frombuffer(b"".join(tokens), dtype="<u4").tolist()
        bs = self.block_size
        for i, j in zip(starts, starts[1:] + [n]):
            self._sink(BlockStored(list(hashes[i:j]), parents[i], toks[i * bs:j * bs], bs, medium))

    def _wants_disk(self, slot: int) -> bool:
        host = self.host
        return (self.disk is not None and not host.on_disk(slot) and host.view(slot).block_hash not in self.disk.entries
                and self._pending_bytes + host.codec.payload_bytes <= self.config.max_pending_write_bytes)

    def _queue_write(self, slot: int, already_pinned: bool = False) -> None:
        """Queue the block in host ``slot`` for the disk writer, pinning the slot until written."""
        host = self.host
        nbytes = host.codec.payload_bytes
        e = host.view(slot)
        if e.block_hash in self.disk.entries:
            host.set_on_disk(slot, True)
            self.disk.touch(e.block_hash)
            if already_pinned:
                host.unpin(slot)
            return
        if self._pending_bytes + nbytes > self.config.max_pending_write_bytes:
            self.stats_counters["writes_skipped"] += 1
            if already_pinned:
                host.unpin(slot)
            return
        if not already_pinned:
            host.pin(slot)
        host.set_on_disk(slot, True)
        self._jobs.append(_WriteJob(e.block_hash, e.parent_hash, e.token_bytes, slot, e.ready, self._generation,
                                    nbytes, host.tenant_of(slot)))
        self._pending_bytes += nbytes
        self._cv.notify_all()

    def _jobs_for(self, slots: Sequence[int], blocks: Sequence[EvictedBlock], ready: object) -> list[_WriteJob]:
        """Write jobs for a batch just stored in the host tier (``blocks[k]`` is in ``slots[k]``),
        built from the evicted blocks' own fields and with their slots pinned."""
        nbytes, gen, pin = self.host.codec.payload_bytes, self._generation, self.host.pin
        jobs = [_WriteJob(b.block_hash, b.parent_hash or ZERO_HASH, b.token_bytes, slot, ready, gen, nbytes,
                          getattr(b, "owner", None))
                for slot, b in zip(slots, blocks)]
        for slot in slots:
            pin(slot)
        return jobs

    def _queue_writes(self, slots: Sequence[int], blocks: Sequence[EvictedBlock], ready: object) -> None:
        """Write-through: queue a batch just stored in the host tier for the disk writer."""
        host, disk = self.host, self.disk
        if not disk.entries.keys().isdisjoint(b.block_hash for b in blocks):  # some already on disk
            keep = []
            for slot, b in zip(slots, blocks):
                if b.block_hash in disk.entries:
                    host.set_on_disk(slot, True)
                    disk.touch(b.block_hash)
                else:
                    keep.append((slot, b))
            slots, blocks = [s for s, _ in keep], [b for _, b in keep]
        nbytes = host.codec.payload_bytes
        room = max(0, (self.config.max_pending_write_bytes - self._pending_bytes) // nbytes)
        if room < len(slots):
            self.stats_counters["writes_skipped"] += len(slots) - room
            slots, blocks = slots[:room], blocks[:room]
        if not slots:
            return
        for slot in slots:
            host.set_on_disk(slot, True)
        self._jobs.extend(self._jobs_for(slots, blocks, ready))
        self._pending_bytes += nbytes * len(slots)
        self._cv.notify_all()

    def _queue_remote(self, slots: Sequence[int], blocks: Sequence[EvictedBlock], ready: object) -> None:
        """Queue a batch just stored in the host tier for the remote writer; past the budget, skip."""
        nbytes = self.host.codec.payload_bytes
        room = max(0, (self.config.max_pending_write_bytes - self._rpending_bytes) // nbytes)
        if room < len(slots):
            self.stats_counters["remote_puts_skipped"] += len(slots) - room
            slots, blocks = slots[:room], blocks[:room]
        if not slots:
            return
        self._rjobs.extend(self._jobs_for(slots, blocks, ready))
        self._rpending_bytes += nbytes * len(slots)
        self._cv.notify_all()

    def _remote_loop(self) -> None:
        """Send queued host blocks to the remote tier, in batches of about ``max_batch_bytes``."""
        rec = HEADER_BYTES + 4 * self.block_size + self.remote_codec.payload_bytes
        per_batch = max(1, self.remote.max_batch_bytes // rec)
        while True:
            with self.lock:
                while not self._rjobs and not self._stop:
                    self._cv.wait()
                if not self._rjobs:
                    return  # stopping and drained
                batch = [self._rjobs.popleft() for _ in range(min(per_batch, len(self._rjobs)))]
                self._rwriting += 1
            try:
                records = run_on_fresh_thread(self._records, batch, self.remote_codec, name="kvmesh-encode")
                stored, _ = self.remote.put_many(records, tenants=[job.owner for job in batch])
            except Exception:  # a bug here must not kill the writer: log it, count it, go on
                log.exception("remote tier: put failed")
                with self.lock:
                    self.stats_counters["remote_put_errors"] += 1
            finally:
                with self.lock:
                    self._rwriting -= 1
                    for job in batch:
                        self._rpending_bytes -= job.nbytes
                        self.host.unpin(job.slot)
                    self._cv.notify_all()

    # -- disk writer thread ------------------------------------------------------------------
    #: Most segments written per writer batch (their directory fsync is shared).
    SEGMENTS_PER_BATCH = 8
    #: Threads writing and fsyncing segments at once: while some wait for the disk, others
    #: copy into the page cache (64 MiB in 16 MiB segments, median of 24 pairs against one
    #: raw file on this VM: 0.76-0.78 with 2 threads, 0.87-0.93 with 4).
    IO_THREADS = 4

    def _write_loop(self) -> None:
        disk = self.disk
        rec = HEADER_BYTES + 4 * self.block_size + self.disk_codec.payload_bytes
        while True:
            with self.lock:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:  # stopping and drained; `close` left the I/O threads to us
                    self._io.shutdown(wait=False)
                    return
                # as few segments as the cap allows, evenly filled (no small trailing file), one
                # tenant's blocks per segment (the disk tier evicts fairly between tenants)
                per_segment = max(1, disk.segment_bytes // rec)
                n = min(len(self._jobs), per_segment * self.SEGMENTS_PER_BATCH)
                taken = [self._jobs.popleft() for _ in range(n)]
                by_owner: dict[object, list[_WriteJob]] = {}
                for job in taken:
                    by_owner.setdefault(job.owner, []).append(job)
                groups: list[tuple[int, list[_WriteJob]]] = []
                for jobs in by_owner.values():
                    m = len(jobs)
                    num_groups = -(-m // per_segment)
                    for g in range(num_groups):
                        lo, hi = m * g // num_groups, m * (g + 1) // num_groups
                        groups.append((disk.new_segment_id(), jobs[lo:hi]))
                self._writing += 1
            try:
                self._write_batch(groups)
            finally:
                with self.lock:
                    self._writing -= 1
                    for _, group in groups:
                        for job in group:
                            self._pending_bytes -= job.nbytes
                            self.host.unpin(job.slot)
                    self._cv.notify_all()

    def _write_batch(self, groups: list[tuple[int, list[_WriteJob]]]) -> None:
        """Write each group as a segment, fsync the directory once, then index them all.

        Preparing a segment (checksums, headers: CPU) overlaps with writing and
        fsyncing the previous ones, on ``IO_THREADS`` ``kvmesh-disk-io`` threads so
        that some segments' fsyncs (the disk busy, the CPU idle) overlap others'
        writes into the page cache. Each segment is still fsynced before its
        rename, so crash safety is that of :meth:`DiskTier.write_segment`.
        """
        pending: list[tuple[Future, list[RecordMeta], list[_WriteJob]]] = []
        error: OSError | None = None
        for seg_id, batch in groups:
            items = run_on_fresh_thread(self._records, batch, self.disk_codec, name="kvmesh-encode")
            pending.append((self._io.submit(self.disk.write_segment, seg_id, items, False),
                            [m for m, _ in items], batch))
        written = []
        for fut, metas, batch in pending:
            try:
                written.append((fut.result(), metas, batch))
            except OSError as exc:
                error = error or exc
        if error is None:
            try:
                self.disk.sync_directory()
            except OSError as exc:
                error = exc
        if error is not None:
            self._write_error_log.error("disk tier: segment write failed: %s", error)
            with self.lock:
                self.stats_counters["write_errors"] += 1
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._shrink_disk_to_fit()
                for _, batch in groups:
                    for job in batch:  # the slot is still pinned by this job: not reused
                        self.host.set_on_disk(job.slot, False)
                for seg, _, _ in written:  # never indexed: do not leave them behind
                    _remove_file(seg.path)
            return
        with self.lock:
            for seg, metas, batch in written:
                if any(job.generation != self._generation for job in batch):
                    _remove_file(seg.path)  # the cache was cleared while this segment was written
                    continue
                added, removed = self.disk.add_segment(seg, metas, batch[0].owner if batch else None)
                self.stats_counters["segments_written"] += 1
                if added:
                    self._emit_chains([m.block_hash for m in added], [m.parent for m in added],
                                      [m.token_bytes for m in added], "disk")
                self._disk_removed(removed)

    def _shrink_disk_to_fit(self) -> None:
        """The filesystem is full (or the quota reached) before ``--disk-bytes``: hold the tier
        to what is on disk now less two segments, evicting down to it, so later writes find
        room instead of failing again. Lasts for this process. Call with the lock held."""
        disk = self.disk
        new = max(disk.segment_bytes, disk.used_bytes - 2 * disk.segment_bytes)
        if new >= disk.capacity_bytes:
            return
        log.warning("disk tier %s: the filesystem is full at %d bytes of segments, under --disk-bytes %d; the tier "
                    "now holds at most %d bytes in this run", disk.directory, disk.used_bytes,
                    disk.capacity_bytes, new)
        disk.capacity_bytes = new
        disk.segment_bytes = min(disk.segment_bytes, new)
        self._disk_removed(disk.evict_to_capacity())

    def _records(self, batch: list[_WriteJob], codec: KVCodec) -> list[tuple[RecordMeta, object]]:
        """``(meta, payload)`` in ``codec`` (or a lossier one, `_slot_record`) for each job's
        (pinned) host slot, checksummed."""
        items = []
        for job in batch:
            if job.ready is not None:
                job.ready.synchronize()
            c, payload = self._slot_record(job.slot, codec)
            items.append((RecordMeta(job.block_hash, job.parent_hash, job.token_bytes, c.name, self.dtype_name,
                                     self.block_shape, len(payload), checksum(payload)), payload))
        return items

    def _disk_removed(self, metas: list[RecordMeta]) -> None:
        if not metas:
            return
        for m in metas:
            slot = self.host.slot_of(m.block_hash) if self.host is not None else None
            if slot is not None:
                self.host.set_on_disk(slot, False)
        self._emit_removed([m.block_hash for m in metas], "disk")

    @staticmethod
    def _transcode(src: KVCodec, row: torch.Tensor, dst: KVCodec) -> memoryview:
        """One slab row in codec ``src`` as a bytes-like payload in codec ``dst``."""
        if src.name != dst.name:
            row = dst.encode(src.decode(row.view(1, -1)))[0]
        return memoryview(row.contiguous().numpy()).cast("B")

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued disk write and remote put finished. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._jobs or self._writing or self._rjobs or self._rwriting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued disk writes and remote puts and stop the writer threads. Idempotent.

        With a disk tier, the host tier's blocks that have no disk copy are queued for it
        first (`_write_host_blocks`): in write-back mode every block still in host memory,
        in write-through mode those whose write was skipped (a full write queue, a failed
        write), so that a restart on the same directory finds them. Queuing them and
        waiting for the queued writes and puts share one deadline, ``timeout`` seconds from
        the call; what is not queued by then is not written. Each writer thread is then
        given up to ``timeout`` more seconds to finish the batch in hand and what is still
        queued (at most ``max_pending_write_bytes`` each).
        """
        if self._writer is None and self._remote_writer is None:
            return
        deadline = time.monotonic() + timeout
        if self._writer is not None and self.host is not None:
            self._write_host_blocks(deadline)
        self.flush(max(0.0, deadline - time.monotonic()))
        with self.lock:
            self._stop = True
            self._cv.notify_all()
        writer_left = False
        for t in (self._writer, self._remote_writer):
            if t is not None:
                t.join(timeout=timeout)
                writer_left |= t is self._writer and t.is_alive()
        self._writer = self._remote_writer = None
        if self.disk is not None and not writer_left:
            # a writer still at work keeps its I/O threads (it shuts them down when it is done) and
            # the folder (the process's exit frees it)
            self._io.shutdown(wait=False)
            self.disk.release()

    def _write_host_blocks(self, deadline: float) -> int:
        """Queue the host tier's blocks that have no disk copy for the disk writer (on stop),
        waiting for room in the write queue, until ``deadline`` (``time.monotonic()``
        seconds).

        Most recently used chains first, each chain parent first (its records adjacent on
        disk, read back with one ``pread``); at most as many blocks as the disk tier holds,
        since writing more would only evict what was just written.

        Returns:
            blocks queued.
        """
        host, disk = self.host, self.disk
        nbytes = host.codec.payload_bytes
        cap = self.config.max_pending_write_bytes
        if nbytes > cap:
            return 0
        with self.lock:
            todo = self._host_blocks_to_write()
            per_block = HEADER_BYTES + 4 * self.block_size + self.disk_codec.payload_bytes
            todo = todo[:max(0, disk.capacity_bytes // per_block)]
            if todo:
                log.info("disk tier %s: stop: writing the %d host-tier block(s) not on disk yet",
                         disk.directory, len(todo))
            queued = 0
            for k, h in enumerate(todo):
                while self._pending_bytes + nbytes > cap and time.monotonic() < deadline:
                    self._cv.wait(max(0.0, deadline - time.monotonic()))
                if self._pending_bytes + nbytes > cap or time.monotonic() >= deadline:
                    log.warning("disk tier %s: stop: out of time after queuing %d host-tier block(s) for disk; "
                                "%d not written are lost", disk.directory, queued, len(todo) - k)
                    break
                slot = host.slot_of(h)  # the lock was let go while waiting: look again
                if slot is None or host.on_disk(slot) or h in disk.entries:
                    continue
                self._queue_write(slot)
                queued += 1
        return queued

    def _host_blocks_to_write(self) -> list[bytes]:
        """Hashes of the host tier's blocks with no disk copy: chains by their most recently
        used block, newest first; within a chain, the blocks from the oldest one not taken yet
        down to that block (parent first). Call under the lock."""
        host, on_disk = self.host, self.disk.entries
        want = {h: slot for h, slot in host.entries.items()
                if not host.on_disk(slot) and h not in on_disk}
        order: list[bytes] = []
        taken: set[bytes] = set()
        for h in reversed(list(want)):  # most recently used first
            path = []
            x = h
            while x in want and x not in taken:
                path.append(x)
                taken.add(x)
                x = host.view(want[x]).parent_hash
            order.extend(reversed(path))
        return order

    # -- lookup and load (engine thread) ------------------------------------------------------
    def locate(self, hashes: Sequence[bytes], block_tokens: Callable[[int], bytes], start: int, stop: int,
               root: bytes) -> list[Located]:
        """Find blocks ``start, start+1, ...`` (before ``stop``) of a chain in the lower tiers.

        Each candidate's identity is verified against the chain (hash, parent,
        tokens, recomputed hash, layout, codec); the walk stops at the first
        position no tier holds verifiably. Host slots found are pinned until
        :meth:`load` or :meth:`release`.

        Args:
            hashes: the request's block hashes, block 0 first.
            block_tokens: ``block_tokens(i)`` is block ``i``'s token bytes.
            start, stop: positions to look at (``stop`` excluded).
            root: the request's namespace root hash.

        The remote tier is not looked at here (this runs in scheduling, which must
        not wait for a network): :meth:`prefetch` stages its blocks, and the disk
        tier's, before the request is submitted, and they are found in the staging
        area. The disk is still read here for what was not prefetched.
        """
        out: list[Located] = []
        if not self.sources or start >= stop:
            return out
        with self.lock:
            for i in range(start, stop):
                h = hashes[i]
                parent = hashes[i - 1] if i > 0 else None
                toks = block_tokens(i)
                found = None
                for src in self.sources:
                    hit = src.find(h)
                    if hit is None:
                        continue
                    handle, medium, meta = hit
                    try:
                        meta.verify_for(h, parent, toks, root, self.dtype_name, self.block_shape)
                        self.check_layout(meta)
                    except RecordError as exc:  # another codec: a plain miss here, not damage
                        (log.debug if isinstance(exc, CodecNotAccepted) else log.warning)(
                            "%s tier: block %s rejected: %s", medium, h.hex()[:12], exc)
                        src.release([handle])
                        continue
                    found = Located(src, handle, medium)
                    break
                if found is None:
                    break
                out.append(found)
        return out

    def release(self, located: list[Located]) -> None:
        """Drop what :meth:`locate` holds for blocks that will not be loaded."""
        with self.lock:
            for run_src, handles in _runs_by_source(located):
                run_src.release(handles)

    def loss_ranks(self, located: list[Located]) -> list[int]:
        """The loss rank (`kv_codec.loss_rank`) each located block's KV would have once
        loaded, in order (0: exact)."""
        with self.lock:
            out: list[int] = []
            for src, handles in _runs_by_source(located):
                out.extend(src.loss_ranks(handles))
            return out

    def load(self, located: list[Located], block_ids: list[int]) -> list[str]:
        """Copy located blocks into pool rows ``block_ids`` (same order), verifying them.

        Stops at the first block that fails (damaged disk record, block gone);
        what :meth:`locate` held for the rest is released.

        Returns:
            the medium credited for each block loaded, in order (a prefix of ``located``).
        """
        media: list[str] = []
        with self.lock:
            pos = 0
            runs = list(_runs_by_source(located))
            row_loss = self.row_loss
            for r, (src, handles) in enumerate(runs):
                rows = block_ids[pos:pos + len(handles)]
                for row, rank in zip(rows, src.loss_ranks(handles)):
                    row_loss[row] = rank
                started = self.clock.start()
                ok = src.load(handles, rows)
                if ok:  # on a GPU, once its copies ran on the device (`clock`)
                    self.clock.stop(started, lambda seconds, _at, kind=src.kind, n=ok:
                                    self._note_load_cost(kind, seconds / n))
                media.extend(loc.medium for loc in located[pos:pos + ok])
                if ok < len(handles):
                    self.stats_counters["load_failures"] += 1
                    src.release(handles[ok:])
                    for later_src, later in runs[r + 1:]:
                        later_src.release(later)
                    break
                pos += len(handles)
            self.stats_counters["loaded"] += len(media)
        return media

    @property
    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` has anything to do: a staging area and a disk or remote tier."""
        return self.peer is not None and (self.disk is not None or self.remote is not None)

    def prefetch(self, hashes: Sequence[bytes], block_tokens: Callable[[int], bytes], start: int, stop: int,
                 root: bytes, compute_seconds_per_block: float | None = None, owner: object = None
                 ) -> dict[str, int]:
        """Stage the request's blocks that only the disk or the remote tier holds (caller's thread).

        Runs in the thread of whoever submits the request, not the engine's, so
        that scheduling never waits for a disk read or for Redis. Under the
        store's lock it walks positions ``start, start+1, ...``: blocks in host
        memory or already staged are left where they are, blocks on disk are
        noted, and the walk ends at the first position no local tier holds (or
        once the blocks noted and this request's blocks already staged fill the
        staging area: it never reads more than it can stage without evicting the
        request's own earlier blocks).
        Without the lock it then reads the disk records (checksummed), and from
        that position on the remote tier's run (one round trip, bounded by
        ``remote_timeout_s``); every block is verified against the chain and
        staged, credited to the tier it came from. The scheduler's
        :meth:`locate` finds them in the staging area. A record that fails its
        checks ends the run, as in :meth:`load` (a damaged disk segment is
        dropped). Blocks the staging area has no room for are simply not
        staged: the scheduler reads them from disk itself, or computes them.
        Under the ``"cost"`` load policy a source measured slower per block than
        ``compute_seconds_per_block`` is not read at all (:meth:`fetch_decision`): on
        a GPU a small model's prefill can beat a disk read or a Redis round trip.
        Each read of at least ``MIN_COST_SAMPLE_BLOCKS`` blocks, and every probe, is timed
        per block read and folded into ``load_seconds_per_block`` under its medium (a probe
        of a few blocks still measures: otherwise a source cut on a workload of short runs
        would never be measured again).

        Args:
            hashes, block_tokens, root: the request's chain, as for :meth:`locate`.
            start: the first position not held by the device pool.
            stop: one past the last position worth loading (``(L - 1) // block_size``).
            compute_seconds_per_block: the worker's prefill time for one block's tokens
                (seconds), or None when not measured yet.
            owner: the request's tenant: staged blocks count as its when the staging area
                evicts (fairly between tenants, as the host tier).

        Returns:
            blocks staged per medium, e.g. ``{"disk": 12, "remote": 40}`` (empty when
            there was nothing to do).
        """
        out: dict[str, int] = {}
        if not self.can_prefetch or start >= stop:
            return out
        # never read more than the staging area holds together with what this request has
        # staged there already (a peer fetch's run): staging past that would evict the
        # request's own leading blocks, and `locate` stops at the first one missing
        budget = self.peer.num_slots
        from_disk: list[tuple[int, DiskEntry]] = []
        staged = 0
        with self.lock:
            generation = self._generation
            i = start
            while i < stop and len(from_disk) + staged < budget:
                h = hashes[i]
                if h in self.peer:
                    staged += 1
                    i += 1
                    continue
                if h in self.host:  # fast enough for scheduling (verified there)
                    i += 1
                    continue
                d = self.disk.entries.get(h) if self.disk is not None else None
                if d is None:
                    break
                try:
                    d.meta.verify_for(h, hashes[i - 1] if i > 0 else None, block_tokens(i), root, self.dtype_name,
                                      self.block_shape)
                    self.check_layout(d.meta)
                except RecordError:
                    break  # the scheduler's locate logs and skips it
                from_disk.append((i, d))
                i += 1
        first = i
        if from_disk:
            decision = self.fetch_decision("disk", compute_seconds_per_block)
            if decision == "cut":
                return out  # the scheduler computes these blocks, and everything after them
            t0 = time.perf_counter()
            entries = [d for _, d in from_disk]
            payloads, ok = self._read_disk(entries)
            if ok < len(entries):
                first = from_disk[ok][0]  # the run ends at the bad record
            if ok:
                out["disk"] = self._stage_quietly([(d.meta, p) for d, p in zip(entries[:ok], payloads)], "disk",
                                                  generation, owner)
                if len(entries) >= self.MIN_COST_SAMPLE_BLOCKS or decision == "probe":
                    self._note_load_cost("disk", (time.perf_counter() - t0) / len(entries))
        room = budget - staged - len(from_disk)
        if self.remote is None or not (first < stop and first == i and room > 0):
            return out
        decision = self.fetch_decision("remote", compute_seconds_per_block)
        if decision == "cut":
            return out
        t0 = time.perf_counter()
        run = self._remote_run(hashes, block_tokens, first, min(stop, first + room), root)
        if run:
            out["remote"] = self._stage_quietly(run, "remote", generation, owner)
            if len(run) >= self.MIN_COST_SAMPLE_BLOCKS or decision == "probe":
                self._note_load_cost("remote", (time.perf_counter() - t0) / len(run))
        return out

    def _remote_run(self, hashes: Sequence[bytes], block_tokens: Callable[[int], bytes], start: int, stop: int,
                    root: bytes) -> list[tuple[RecordMeta, memoryview]]:
        """Records of blocks ``start, start+1, ...`` from the remote tier (one round trip, no
        lock), each verified against the chain; the run ends at the first that fails."""
        out = []
        for k, (meta, payload) in enumerate(self.remote.get_run(hashes[start:stop])):
            i = start + k
            try:
                meta.verify_for(hashes[i], hashes[i - 1] if i > 0 else None, block_tokens(i), root,
                                self.dtype_name, self.block_shape)
            except RecordError as exc:
                log.warning("remote tier: block %s rejected: %s", hashes[i].hex()[:12], exc)
                break
            try:
                self.check_codec(meta)  # usable by workers that accept its codec: left in place
            except RecordError as exc:
                log.info("remote tier: block %s not used: %s", hashes[i].hex()[:12], exc)
                break
            try:
                self.check_layout(meta)
            except RecordError as exc:  # stored under its own hash but unusable by anyone with this model
                log.warning("remote tier: block %s unusable, deleting it: %s", hashes[i].hex()[:12], exc)
                self.remote.forget([hashes[i]])
                break
            out.append((meta, payload))
        return out

    def _read_disk(self, entries: list[DiskEntry]) -> tuple[list, int]:
        """Read records: ``(payloads, how many leading ones are good)``. Safe without the
        store's lock (prefetch) and under it (load).

        A segment that failed a check while still indexed is dropped (under the lock);
        one evicted meanwhile is just a miss.
        """
        try:
            return self.disk.read(entries), len(entries)
        except SegmentReadError as exc:
            ok, good = exc.index, []
            if ok:  # the records before the bad one, read again before its segment goes
                try:
                    good = self.disk.read(entries[:ok])
                except SegmentReadError:
                    ok = 0
            with self.lock:
                if exc.damaged and exc.segment in self.disk.segments:
                    self._drop_damaged(exc)
            return good, ok

    def _stage_quietly(self, blocks: list[tuple[RecordMeta, object]], origin: str, generation: int,
                       owner: object = None) -> int:
        try:
            return self.stage(blocks, origin=origin, generation=generation, owner=owner)
        except RecordError as exc:
            log.warning("%s tier: blocks not staged: %s", origin, exc)
            return 0

    # -- peer staging ----------------------------------------------------------------------------
    def stage(self, blocks: list[tuple[RecordMeta, object]], origin: str = "peer", generation: int | None = None,
              owner: object = None) -> int:
        """Keep verified blocks fetched from a peer (or the remote tier) until the request that
        asked for them loads them.

        Args:
            blocks: ``(meta, payload)`` pairs whose payloads were checked
                (``block_record.verify_payload``) and whose identity was
                verified against the request's chain by the caller.
            origin: the medium the blocks are credited to when loaded.
            generation: the store's ``generation`` when the caller started reading
                the blocks; if the cache was cleared since, nothing is staged.
            owner: the tenant of the request they were read for (None: unknown). The
                staging area evicts fairly between tenants, as the host tier does, so one
                tenant's prefetches cannot push out the blocks staged for another's request.

        Returns:
            how many were staged (0 without a staging area; fewer when it is full).

        Raises:
            RecordError: a record's layout, codec or payload size does not fit
                this pool (checked before anything is decoded).
        """
        peer = self.peer
        if peer is None or not blocks:
            return 0
        for meta, _ in blocks:
            self.check_layout(meta)
        decoded = self._decode_records(blocks)  # [n, *block_shape] on CPU
        with self.lock:
            if generation is not None and generation != self._generation:
                return 0  # cleared while these were read: they must not outlive the clear
            fresh = [i for i, (m, _) in enumerate(blocks) if m.block_hash not in peer]
            slots, _, _ = peer.reserve(len(fresh), incoming={owner: len(fresh)})
            fresh = fresh[:len(slots)]
            if not fresh:
                return 0
            rows = peer.codec.encode(decoded[fresh])
            for row, slot in zip(rows, slots):
                peer.slab[slot].copy_(row)
            peer.insert_many([_Staged(blocks[i][0].block_hash, blocks[i][0].parent_hash, blocks[i][0].token_bytes,
                                      owner) for i in fresh],
                             slots, origin=None if origin == peer.medium else origin,
                             loss=[loss_rank(blocks[i][0].codec) for i in fresh])
            return len(fresh)

    def _decode_into(self, metas: Sequence[RecordMeta], payloads: Sequence[object], block_ids: Sequence[int]) -> None:
        """Decode record payloads (verified) into pool rows ``block_ids``, one batch per run of one codec."""
        kv = self.kv_cache
        i, n = 0, len(metas)
        while i < n:
            j = i + 1
            name = metas[i].codec
            while j < n and metas[j].codec == name:
                j += 1
            codec = self.codec(name)
            raw = bytearray().join(payloads[i:j])
            rows = torch.frombuffer(raw, dtype=torch.uint8).view(j - i, codec.payload_bytes)
            decoded = codec.decode(rows).to(kv.device)
            kv.index_copy_(0, torch.tensor(list(block_ids[i:j]), dtype=torch.long, device=kv.device), decoded)
            i = j

    @property
    def generation(self) -> int:
        """Bumped by every :meth:`clear`; see :meth:`stage`."""
        return self._generation

    def check_codec(self, meta: RecordMeta) -> None:
        """Raise RecordError unless the record's codec is one this pool accepts
        (``accepted_codecs``: exact, or a codec one of this worker's tiers is set to)."""
        if meta.codec not in self.accepted_codecs:
            raise CodecNotAccepted(f"record is {meta.codec}-encoded; this worker's tiers keep "
                              f"{'/'.join(sorted(self.accepted_codecs))} KV (--host/--disk/--remote-codec)")

    def check_layout(self, meta: RecordMeta) -> None:
        """Raise RecordError unless a record's dtype, block shape, codec and payload size fit this pool.

        The payload size is checked against the codec's, not only against the
        record's own header: a well-formed record of the wrong size must be a
        miss, never a decoder error.
        """
        if meta.dtype != self.dtype_name or tuple(meta.shape) != self.block_shape:
            raise RecordError(f"record is {meta.dtype} {tuple(meta.shape)}; this pool is "
                              f"{self.dtype_name} {self.block_shape}")
        if meta.codec not in CODECS:
            raise RecordError(f"unknown codec {meta.codec!r}")
        self.check_codec(meta)
        want = self.codec(meta.codec).payload_bytes
        if meta.payload_len != want:
            raise RecordError(f"{meta.codec} payload of {meta.payload_len} bytes; this pool's is {want}")

    def _decode_records(self, blocks: list[tuple[RecordMeta, object]]) -> torch.Tensor:
        out = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype)
        for i, (meta, payload) in enumerate(blocks):
            codec = self.codec(meta.codec)
            row = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(1, -1)
            out[i] = codec.decode(row)[0]
        return out

    # -- export (serving peers) ---------------------------------------------------------------------
    def export(self, hashes: Sequence[bytes], start: int) -> list[tuple[RecordMeta, bytes]]:
        """Records for ``hashes[start:]`` held in the host or disk tier, in order, stopping at the first gap.

        Payloads keep their tier's codec, or the lossier one their KV went through before
        (`_slot_record`); checksums are computed here for host blocks.
        """
        out: list[tuple[RecordMeta, bytes]] = []
        with self.lock:
            for i in range(start, len(hashes)):
                h = hashes[i]
                e = self.host.get(h) if self.host is not None else None
                if e is not None:
                    if e.ready is not None:
                        e.ready.synchronize()
                    c, view = self._slot_record(e.slot, self.host.codec)
                    payload = bytes(view)
                    out.append((RecordMeta(h, e.parent_hash, e.token_bytes, c.name, self.dtype_name,
                                           self.block_shape, len(payload), checksum(payload)), payload))
                    continue
                d = self.disk.entries.get(h) if self.disk is not None else None
                if d is None:
                    break
                try:
                    (payload,) = self.disk.read([d])
                except SegmentReadError as exc:
                    self._drop_damaged(exc)
                    break
                out.append((d.meta, bytes(payload)))
        return out

    def _drop_damaged(self, exc: SegmentReadError) -> None:
        if not exc.damaged:
            return
        log.warning("disk tier: %s; dropping the segment", exc)
        self.disk.num_damaged += 1
        self._disk_removed(self.disk.drop_segment(exc.segment))

    # -- whole-store operations -----------------------------------------------------------------------
    def snapshot(self) -> list[tuple[bytes, bytes | None, str]]:
        """``(hash, parent or None, medium)`` of every host and disk block (staging excluded)."""
        out = []
        with self.lock:
            if self.host is not None:
                out.extend((h, parent, "host") for h, parent in self.host.blocks())
            if self.disk is not None:
                out.extend((m.block_hash, m.parent, "disk") for m in (d.meta for d in self.disk.entries.values()))
        return out

    def clear(self) -> int:
        """Drop every block of every lower tier (queued disk writes are discarded). Returns blocks dropped.

        Emits no events: the caller's ``AllBlocksCleared`` covers them.
        """
        with self.lock:
            self._generation += 1
            n = 0
            while self._jobs:
                job = self._jobs.popleft()
                self._pending_bytes -= job.nbytes
                self.host.unpin(job.slot)
            while self._rjobs:  # the remote tier itself is the cluster's: it is not cleared
                job = self._rjobs.popleft()
                self._rpending_bytes -= job.nbytes
                self.host.unpin(job.slot)
            for tier in (self.host, self.peer):
                if tier is not None:
                    n += len(tier.clear())
            if self.disk is not None:
                n += len(self.disk.clear())
            self._cv.notify_all()
            return n

    def clear_host(self) -> int:
        """Drop the host tier only (events emitted); disk keeps its copies. Returns blocks dropped."""
        with self.lock:
            if self.host is None:
                return 0
            dropped = self.host.clear()
            self._emit_removed(dropped, "host")
            return len(dropped)

    def stats(self) -> dict:
        """Block and byte counts per tier plus the counters (blocks, bytes).

        ``disk_bytes`` is every segment file's bytes, those of foreign segments
        (``disk_foreign_segments``, ``disk_foreign_bytes``: another layout or codec, left on
        disk but not indexed, see ``disk_tier``) included.
        """
        remote = self.remote.stats() if self.remote is not None else {}  # Redis calls: outside the lock
        with self.lock:
            out = dict(self.stats_counters)
            if self.host is not None:
                out.update(host_blocks=len(self.host), host_bytes=self.host.used_bytes,
                           host_capacity_bytes=self.host.capacity_bytes)
            if self.peer is not None:
                out.update(peer_staged_blocks=len(self.peer))
            if self.disk is not None:
                out.update(disk_blocks=len(self.disk.entries), disk_bytes=self.disk.used_bytes,
                           disk_capacity_bytes=self.disk.capacity_bytes, disk_damaged=self.disk.num_damaged,
                           disk_torn=self.disk.num_torn, pending_write_bytes=self._pending_bytes,
                           disk_foreign_segments=len(self.disk.foreign),
                           disk_foreign_bytes=self.disk.foreign_bytes)
            if self.remote is not None:
                out.update(remote, pending_remote_bytes=self._rpending_bytes)
            return out


_hash_of = operator.attrgetter("block_hash")


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _runs_by_source(located: list[Located]):
    i = 0
    while i < len(located):
        j = i + 1
        while j < len(located) and located[j].source is located[i].source:
            j += 1
        yield located[i].source, [loc.handle for loc in located[i:j]]
        i = j


class _HostSource(_Source):
    """The host tier, or the peer staging area (``consume``: entries leave once loaded)."""

    def __init__(self, store: TierStore, tier: HostTier, consume: bool):
        self.store = store
        self.tier = tier
        self.consume = consume
        self.kind = tier.medium

    def find(self, block_hash):
        e = self.tier.get(block_hash)
        if e is None:
            return None
        self.tier.pin(e.slot)
        s, c = self.store, self.tier.codec
        return e, e.origin, host_meta(e.block_hash, e.parent_hash, e.token_bytes, c.name, s.dtype_name,
                                      s.block_shape, c.payload_bytes)

    def loss_ranks(self, handles):
        return [self.tier.loss_rank(e.slot) for e in handles]

    def load(self, handles, block_ids):
        self.tier.load(self.store.kv_cache, [e.slot for e in handles], block_ids)
        for e in handles:
            self.tier.unpin(e.slot)
            if self.consume:
                self.tier.remove(e.block_hash)
            else:
                self.tier.touch(e.block_hash)
        return len(handles)

    def release(self, handles):
        for e in handles:
            self.tier.unpin(e.slot)


class _DiskSource(_Source):
    """The disk tier; payloads are read, checksummed and decoded on load."""

    kind = "disk"

    def __init__(self, store: TierStore):
        self.store = store

    def find(self, block_hash):
        d = self.store.disk.entries.get(block_hash)
        if d is None:
            return None
        return d, "disk", d.meta

    def loss_ranks(self, handles: list[DiskEntry]):
        return [loss_rank(d.meta.codec) for d in handles]

    def load(self, handles: list[DiskEntry], block_ids):
        s = self.store
        payloads, ok = s._read_disk(handles)
        if ok == 0:
            return 0
        s._decode_into([d.meta for d in handles[:ok]], payloads[:ok], block_ids[:ok])
        for d in handles[:ok]:
            s.disk.touch(d.meta.block_hash)
        return ok

    def release(self, handles):
        pass


def _connect_remote(config: TierConfig) -> RemoteTier:
    """A :class:`RemoteTier` on ``config.remote_url`` whose every call is bounded by the timeout."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    t = config.remote_timeout_s
    client = redis.Redis.from_url(config.remote_url, socket_timeout=t, socket_connect_timeout=t,
                                  retry=Retry(NoBackoff(), 0))  # one attempt: a failure is a miss
    cluster = f"{config.remote_cluster}.{config.producer}" if config.producer else config.remote_cluster
    if config.remote_record_key is not None:
        # workers with another key (or none) keep to their own keys: a MAC failure in here is
        # tampering, not a rotation or a rolling upgrade deleting the other side's records
        cluster += ".k" + record_key_id(config.remote_record_key)
    if config.remote_record_key is None:
        log.warning("remote tier: records are not authenticated, so anyone who can write to the cluster's Redis "
                    "can change the KV this worker loads from it; give every worker the same "
                    "--remote-record-key-file (kvmesh up and kvmesh ray make one unless --insecure) and keep Redis "
                    "behind a password")
    return RemoteTier(client, config.remote_bytes, cluster=cluster, record_key=config.remote_record_key)


#: Lookup sources by kind, in lookup order: ``factory(store)`` returns the source, or
#: None when that tier is off.
SOURCES: dict[str, Callable[[TierStore], _Source | None]] = {
    "host": lambda s: _HostSource(s, s.host, consume=False) if s.host is not None else None,
    "peer": lambda s: _HostSource(s, s.peer, consume=True) if s.peer is not None else None,
    "disk": lambda s: _DiskSource(s) if s.disk is not None else None,
}
