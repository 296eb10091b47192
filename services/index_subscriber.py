"""Router side of the KV event plane: keeps a ClusterIndex in step with Redis.

One asyncio task polls the worker registry (``kvmesh:{cluster}:workers`` and
each worker's lease key, see :mod:`workers.kv_publisher`) every
``poll_interval_s`` and, in between, reads every live worker's event stream
with a single ``XREAD BLOCK``. Batches go to :meth:`ClusterIndex.apply_batch`.

Recovery, per worker:

* new worker (or one seen again after its lease lapsed): its stream is read
  from the start, so a router started late rebuilds the index from Redis alone;
* gap (a batch skipped, e.g. trimmed from the stream or dropped by the
  publisher), malformed entry, or a stream that starts past the next seq: the
  ``resync`` callback (the worker's GetSnapshot RPC, supplied by the router)
  is awaited in a task of its own, its snapshot replaces the worker's entries,
  and reading resumes where it stopped; batches the snapshot already covers
  are skipped as duplicates. A failed resync drops the worker's entries and
  is retried with backoff;
* restart (the stream's ``epoch`` field changes): the worker's entries are
  dropped and the new numbering is applied from its first batch;
* lease lapsed (or deleted by a worker draining): the worker's entries leave
  the index at the next registry poll, i.e. within the lease TTL plus
  ``poll_interval_s``.

Recovery, all workers at once: Redis lost its data, because it restarted empty
(``INFO server`` reports a new ``run_id``) or its keys were wiped in place
(``FLUSHALL``, ``FLUSHDB``, a deleted namespace: the cluster's data marker, a
random token at ``kvmesh:{cluster}:data-marker`` that each poll writes when
absent, went away or changed). Every lease vanishes at once although the
workers are up; each known worker then stays live for
``redis_restart_grace_s`` or until its lease is back, whichever comes first
(a worker that re-registered and then leaves is dropped at once), its entries
are kept meanwhile, and it is resynced from its snapshot once its lease is
back. A worker not back within the grace is dropped.

Recovery, a stall: Redis (or this process) stopped answering for longer than the leases'
TTL (``CLIENT PAUSE`` during a failover, a slow fork, a network stall) and the leases
expired meanwhile on Redis's clock, although no worker left. A poll answered ``STALL_S``
(or four poll intervals, if longer) or more after the previous one that finds more than half of the known workers'
leases gone keeps those workers (and their entries) for up to ``STALL_GRACE_S`` while they
beat again; their streams are intact, so nothing is resynced.

All Redis calls go through ``redis.asyncio``; nothing here blocks the loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Awaitable, Callable

import redis
import redis.asyncio as aioredis

from kvmesh.cache_store.events import decode_batch
from kvmesh.services.aio import within
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.workers.kv_publisher import DEFAULT_CLUSTER, lease_key, prune_worker_ids, stream_key, workers_key

__all__ = ["IndexSubscriber", "ResyncFn", "data_marker_key"]

log = logging.getLogger(__name__)

#: ``resync(worker_id, address) -> (seq, [(block_hash, parent_hash | None, medium), ...])``
ResyncFn = Callable[[str, str], Awaitable[tuple[int, list[tuple[bytes, bytes | None, str]]]]]

_BACKOFF_MAX_S = 10.0


def data_marker_key(cluster: str = DEFAULT_CLUSTER) -> str:
    """Redis key of the cluster's data marker (a string: a random token, no TTL):
    ``kvmesh:{cluster}:data-marker``. Index subscribers write it when it is absent and note
    its value; a value gone or changed means Redis lost the cluster's keys (``FLUSHALL``,
    ``FLUSHDB``, an empty restart) while the workers may all be up."""
    return f"kvmesh:{cluster}:data-marker"


#: Writes the data marker when absent (KEYS: the marker; ARGV: a new token), also while Redis
#: is over its maxmemory under noeviction (Redis >= 7.0 script flags): an operator may well
#: flush a Redis the remote tier filled, and the marker must be there to tell.
_MARKER_SET_OOM = "#!lua flags=allow-oom\nreturn redis.call('SET', KEYS[1], ARGV[1], 'NX')"


def _id_key(stream_id: bytes | str) -> tuple[int, int]:
    """Stream entry id ``"<ms>-<n>"`` as a comparable tuple."""
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    ms, _, n = stream_id.partition("-")
    return int(ms), int(n or 0)


class _StreamState:
    __slots__ = ("cursor", "epoch", "resync_task", "hold_until", "failures", "last_resync", "must_resync")

    def __init__(self) -> None:
        self.cursor: bytes | str = "0"          # last entry id consumed
        self.epoch: bytes | None = None         # publisher epoch of the entries applied
        self.resync_task: asyncio.Task | None = None
        self.hold_until = 0.0                   # loop time before which the stream is not read
        self.failures = 0                       # consecutive failed resyncs
        self.last_resync = float("-inf")        # loop time the last resync ended
        self.must_resync = False                # Redis lost its data: resync when the lease is back


class IndexSubscriber:
    """Feeds a :class:`ClusterIndex` from the workers' Redis event streams.

    Args:
        redis_url: Redis URL.
        index: the index to keep up to date (only this subscriber's task mutates it;
            share the event loop with its readers).
        resync: ``async (worker_id, address) -> (seq, blocks)``, the worker's
            snapshot: ``blocks`` as for :meth:`ClusterIndex.apply_snapshot`,
            ``seq`` the last event batch it reflects.
        cluster: cluster name (key prefix).
        poll_interval_s: registry poll period and longest XREAD block (seconds).
        read_count: most entries read per stream per XREAD (batches).
        redis_restart_grace_s: after Redis lost its data (a restart with a new ``run_id``,
            or ``FLUSHALL`` / ``FLUSHDB``, seen by the data marker), how long each worker
            known then stays live while its lease is missing (seconds); 0 drops them at once.

    Attributes:
        resyncs: snapshots applied so far.
        resync_failures: resync callbacks that raised so far.
        data_losses: times Redis was seen to have lost the cluster's keys (restarts and flushes).

    Raises:
        ValueError: ``poll_interval_s`` or ``read_count`` is not positive, or
            ``redis_restart_grace_s`` is negative.
    """

    #: A registry poll answered this long (seconds) after the previous one follows a stall
    #: (of Redis or of this process): leases that lapsed meanwhile are no news of workers.
    STALL_S = 2.0
    #: How long (seconds) workers whose leases lapsed during a stall are kept while they beat
    #: again (at most ``redis_restart_grace_s``).
    STALL_GRACE_S = 5.0
    #: Seconds between prunings of gone workers' ids, and most ids looked at in one.
    PRUNE_EVERY_S = 60.0
    PRUNE_BATCH = 5000

    def __init__(self, redis_url: str, index: ClusterIndex, resync: ResyncFn,
                 cluster: str = DEFAULT_CLUSTER, poll_interval_s: float = 0.5, read_count: int = 512,
                 redis_restart_grace_s: float = 10.0):
        if poll_interval_s <= 0 or read_count < 1 or redis_restart_grace_s < 0:
            raise ValueError("poll_interval_s and read_count must be positive, redis_restart_grace_s >= 0")
        self.redis_restart_grace_s = redis_restart_grace_s
        self._run_id: str | None = None       # Redis server run_id: a new one means its data is gone
        self._marker: bytes | None = None     # the data marker's value last read (None: not known)
        self._marker_flagged = True           # False: this Redis knows no script flags, plain SET NX
        self._grace_until = float("-inf")     # loop time until which missing leases are kept
        self._awaited: set[str] = set()       # workers known when Redis lost its data, not back yet
        self._answered: float | None = None   # loop time of the last registry poll's first reply
        #: stalls after which lapsed leases were kept (see the module docstring)
        self.stalls = 0
        self.data_losses = 0
        self.index = index
        self.cluster = cluster
        self.poll_interval_s = poll_interval_s
        self.read_count = read_count
        self._resync_fn = resync
        # Replies never take longer than one XREAD block; the margin only bounds a dead connection.
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=poll_interval_s + 10.0,
                                              socket_connect_timeout=5.0)
        self._next_prune = float("-inf")      # loop time of the next pruning of gone workers' ids
        #: ids of gone workers removed from the registry set (see `prune_worker_ids`)
        self.pruned_ids = 0
        self._live: dict[str, dict] = {}
        #: bumped whenever the live set or a lease changes (each poll): a router keeps what it
        #: derives from `live_workers` (compatibility, contexts) until this moves
        self.live_version = 0
        self._streams: dict[str, _StreamState] = {}
        self._task: asyncio.Task | None = None
        self._poll_now = asyncio.Event()
        self._polls = 0
        self._stopping = False
        self.resyncs = 0
        #: workers dropped because their lease lapsed
        self.lease_expiries = 0
        #: called with each `EventBatch` applied to the index (metrics: event lag)
        self.on_batch: Callable[[object], None] | None = None
        self.resync_failures = 0

    # ------------------------------------------------------------------ API
    def start(self) -> asyncio.Future:
        """Start the background task on the running event loop.

        Returns:
            An already completed future, so both ``sub.start()`` and
            ``await sub.start()`` work.

        Raises:
            RuntimeError: no running event loop, or already started.
        """
        if self._task is not None:
            raise RuntimeError("IndexSubscriber already started")
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="kv-index-subscriber")
        done = loop.create_future()
        done.set_result(None)
        return done

    async def stop(self, timeout: float = 5.0) -> None:
        """Cancel the task and any resyncs in flight, and close the Redis client.

        Each of the two steps waits at most ``timeout`` seconds: redis-py's asyncio client
        can swallow a cancellation during a blocking read, or wait forever for a socket to
        finish closing (redis/redis-py#2028, #3941), and a shutdown must not hang on either;
        what does not finish in time is abandoned with a warning.
        """
        self._stopping = True  # the main loop also checks this: it ends even if a cancel is lost
        tasks = [st.resync_task for st in self._streams.values() if st.resync_task is not None]
        if self._task is not None:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: an error while stopping is not worth a warning
            if pending:
                log.warning("kv index subscriber: %d task(s) did not stop within %.1f s", len(pending), timeout)
        self._task = None
        try:
            await within(self._redis.aclose(), timeout)
        except (asyncio.TimeoutError, redis.RedisError, OSError) as exc:
            log.warning("kv index subscriber: redis client did not close within %.1f s (%r)", timeout, exc)

    def live_workers(self) -> dict[str, dict]:
        """``{worker_id: lease contents}`` (address, load, block_size, ...) as of the last poll."""
        return dict(self._live)

    async def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until the next registry poll has run and every live worker's stream
        has been consumed up to the last entry it had when that poll finished,
        with no resync in flight.

        Raises:
            TimeoutError: not synced within ``timeout`` seconds.
            RuntimeError: the subscriber is not running.
        """
        try:
            await within(self._wait_synced(), timeout)
        except asyncio.TimeoutError:  # a distinct class before Python 3.11
            raise TimeoutError(f"index not synced within {timeout} s") from None

    async def _wait_synced(self) -> None:
        polls = self._polls
        self._poll_now.set()
        while self._polls <= polls:
            self._check_running()
            await asyncio.sleep(0.01)
        live = list(self._live)
        if not live:
            return
        pipe = self._redis.pipeline(transaction=False)
        for w in live:
            pipe.xrevrange(stream_key(w, self.cluster), count=1)
        tails = await pipe.execute()
        targets = {w: _id_key(t[0][0]) for w, t in zip(live, tails) if t}
        while True:
            self._check_running()
            pending = False
            for w, target in targets.items():
                st = self._streams.get(w)
                if st is None:  # left meanwhile
                    continue
                if st.resync_task is not None or _id_key(st.cursor) < target:
                    pending = True
                    break
            if not pending:
                return
            await asyncio.sleep(0.01)

    def _check_running(self) -> None:
        if self._task is None:
            raise RuntimeError("IndexSubscriber is not running")
        if self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            raise RuntimeError("IndexSubscriber task ended") from exc

    # ------------------------------------------------------------ main loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_poll = 0.0
        backoff = 0.0
        while not self._stopping:
            try:
                now = loop.time()
                if now >= next_poll or self._poll_now.is_set():
                    self._poll_now.clear()
                    await self._discover()
                    self._polls += 1
                    next_poll = loop.time() + self.poll_interval_s
                await self._read_once(next_poll)
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except (redis.RedisError, OSError) as exc:
                if self._stopping:
                    return
                backoff = min(_BACKOFF_MAX_S, max(self.poll_interval_s, backoff * 2))
                log.warning("kv index subscriber: redis error (%s); retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)

    def _check_data_loss(self, info, marker) -> None:
        """Notice a Redis that lost the cluster's keys: it came back empty (its ``run_id``, from
        ``INFO server``, changed) or they were wiped in place (the data marker, ``marker`` as
        read at the end of this poll, is gone or changed; an exception: it could not be read).
        The workers' leases and streams are gone until they write them again, which is no
        reason to forget them: the workers known now stay live for the grace, or until their
        lease is back, and are resynced from their snapshots."""
        run_id = info.get("run_id") if isinstance(info, dict) else None
        why = None
        if run_id and self._run_id is not None and run_id != self._run_id:
            why = "redis restarted (new run_id)"
        if not isinstance(marker, Exception):
            if why is None and self._marker is not None and marker != self._marker:
                why = "the cluster's keys in redis were wiped (FLUSHALL, FLUSHDB or deleted: its data marker changed)"
            self._marker = marker
        if run_id:
            self._run_id = run_id
        if why is None:
            return
        self.data_losses += 1
        self._grace_until = asyncio.get_running_loop().time() + self.redis_restart_grace_s
        self._awaited |= set(self._live)
        for st in self._streams.values():
            st.cursor = "0"          # the streams start over
            st.must_resync = True    # and what was in the old ones may be lost
        log.warning("%s; keeping %d known worker(s) for up to %.1f s while they re-register, then resyncing each "
                    "from its snapshot", why, len(self._awaited), self.redis_restart_grace_s)

    async def _discover(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.smembers(workers_key(self.cluster))
        pipe.info("server")
        raw_members, info = await pipe.execute()
        answered = asyncio.get_running_loop().time()
        gap = answered - self._answered if self._answered is not None else 0.0
        stalled = gap >= max(self.STALL_S, 4 * self.poll_interval_s)
        self._answered = answered
        members = sorted(m.decode() if isinstance(m, bytes) else m for m in raw_members)
        # The marker is read after the leases, in the same round trip: Redis runs the commands
        # in order, so leases read after a flush come with a marker read after it too.
        marker = data_marker_key(self.cluster)
        pipe = self._redis.pipeline(transaction=False)
        if members:
            pipe.mget([lease_key(w, self.cluster) for w in members])
        if self._marker_flagged:  # a no-op while the marker exists
            pipe.eval(_MARKER_SET_OOM, 1, marker, uuid.uuid4().hex)
        else:
            pipe.set(marker, uuid.uuid4().hex, nx=True)
        pipe.get(marker)
        replies = await pipe.execute(raise_on_error=False)
        values = replies[0] if members else []
        if isinstance(values, Exception):
            raise values
        if isinstance(replies[-2], Exception):  # not written this time: it is only a hint
            if self._marker_flagged and not isinstance(replies[-2], redis.exceptions.OutOfMemoryError):
                self._marker_flagged = False  # a Redis before 7.0 refuses the flags line
            log.debug("data marker not written: %s", replies[-2])
        self._check_data_loss(info, replies[-1])
        live: dict[str, dict] = {}
        for w, raw in zip(members, values):
            if raw is None:
                continue
            try:
                lease = json.loads(raw)
            except ValueError:
                log.warning("ignoring malformed lease of worker %s", w)
                continue
            if isinstance(lease, dict):
                live[w] = lease
        lapsed = set(self._live) - set(live)
        if stalled and self.redis_restart_grace_s > 0 and 2 * len(lapsed) > len(self._live):
            keep = min(self.redis_restart_grace_s, self.STALL_GRACE_S)
            self.stalls += 1
            self._awaited |= lapsed
            self._grace_until = max(self._grace_until, answered + keep)
            log.warning("redis answered %.1f s after the previous poll and %d of %d worker lease(s) lapsed "
                        "meanwhile; keeping them for up to %.1f s while they beat again",
                        gap, len(lapsed), len(self._live), keep)
        if self._awaited:
            self._awaited -= set(live)  # back: from now on its lease alone counts
            if asyncio.get_running_loop().time() < self._grace_until:
                for w in self._awaited:  # not yet re-registered after Redis lost its data
                    if w in self._live:
                        live[w] = self._live[w]
            else:
                log.warning("%d worker(s) did not re-register within the grace after redis lost its data or "
                            "stalled: %s", len(self._awaited), ", ".join(sorted(self._awaited)))
                self._awaited.clear()
        for w in [w for w in self._streams if w not in live]:
            self._forget(w)
        for w in self.index.workers():
            if w not in live:
                self.index.remove_worker(w)
        for w in live:
            if w not in self._streams:
                self._streams[w] = _StreamState()
        self._live = live
        self.live_version += 1
        await self._check_tails(live, fresh={w for w, raw in zip(members, values) if raw is not None})
        gone = [w for w, raw in zip(members, values) if raw is None]
        if gone and asyncio.get_running_loop().time() >= self._next_prune:
            await self._prune(gone)

    async def _prune(self, gone: list[str]) -> None:
        """Drop ids of workers long gone (no lease, stream expired) from the registry set,
        so that each poll reads the leases of live workers and not of every pod that ever
        ran. At most `PRUNE_BATCH` ids per `PRUNE_EVERY_S`; an error only delays it."""
        self._next_prune = asyncio.get_running_loop().time() + self.PRUNE_EVERY_S
        try:
            for i in range(0, min(len(gone), self.PRUNE_BATCH), 500):
                self.pruned_ids += int(await prune_worker_ids(self._redis, gone[i:i + 500], self.cluster))
        except redis.RedisError as exc:
            log.info("registry of gone workers not pruned this time: %s", exc)

    async def _check_tails(self, live: dict[str, dict], fresh: set[str]) -> None:
        """Resync workers whose index lags what their lease says they published.

        A lease carries ``kv_seq`` (last batch appended or dropped) and ``kv_epoch``. When
        the index holds less of a worker than ``kv_seq``, or entries of another epoch, and
        its stream has nothing left to read (the tail was trimmed, deleted or never
        written), no future batch would reveal it: resync from the worker's snapshot.
        Also resyncs a worker whose lease is back after Redis lost its data (restart, flush).
        """
        loop = asyncio.get_running_loop()
        suspects = []
        for w in fresh:
            st = self._streams.get(w)
            lease = live.get(w) or {}
            if st is None or st.resync_task is not None or st.hold_until > loop.time():
                continue
            if st.must_resync:
                st.must_resync = False
                self._start_resync(w, st)
                continue
            seq = lease.get("kv_seq")
            if not isinstance(seq, int):
                continue  # a worker that does not report it
            epoch = str(lease.get("kv_epoch", "")).encode()
            other_epoch = st.epoch is not None and bool(epoch) and epoch != st.epoch
            if other_epoch or (self.index.last_seq(w) or 0) < seq:
                suspects.append((w, st, epoch))
        if not suspects:
            return
        pipe = self._redis.pipeline(transaction=False)
        for w, _, _ in suspects:
            pipe.xrevrange(stream_key(w, self.cluster), count=1)
        tails = await pipe.execute()
        for (w, st, epoch), tail in zip(suspects, tails):
            if tail and _id_key(tail[0][0]) > _id_key(st.cursor):
                continue  # still entries to read: they carry on, or show a gap
            log.warning("worker %s published batches its stream no longer holds (index at seq %s, lease at %s); "
                        "resyncing from its snapshot", w, self.index.last_seq(w), live[w].get("kv_seq"))
            if epoch:
                st.epoch = epoch  # the snapshot is of this process
            self._start_resync(w, st)

    def _forget(self, worker_id: str) -> None:
        st = self._streams.pop(worker_id)
        if st.resync_task is not None:
            st.resync_task.cancel()
        self.index.remove_worker(worker_id)
        self.lease_expiries += 1
        log.info("worker %s left (lease gone); dropped from the index", worker_id)

    async def _read_once(self, next_poll: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        wanted = {stream_key(w, self.cluster): st.cursor for w, st in self._streams.items()
                  if st.resync_task is None and st.hold_until <= now}
        wait_s = next_poll - now
        if wait_s <= 0:
            return
        if not wanted:
            try:
                await within(self._poll_now.wait(), wait_s)
            except asyncio.TimeoutError:  # builtin TimeoutError only from Python 3.11
                pass
            return
        reply = await self._redis.xread(wanted, count=self.read_count, block=max(1, int(wait_s * 1000)))
        if isinstance(reply, dict):  # RESP3 shape
            reply = list(reply.items())
        prefix = stream_key("", self.cluster)
        for key, entries in reply or ():
            key = key.decode() if isinstance(key, bytes) else key
            worker_id = key[len(prefix):]
            st = self._streams.get(worker_id)
            if st is not None:
                self._consume(worker_id, st, entries)

    def _consume(self, worker_id: str, st: _StreamState, entries: list) -> None:
        for entry_id, fields in entries:
            epoch = fields.get(b"epoch", b"")
            if st.epoch is not None and epoch != st.epoch:
                log.info("worker %s restarted (new epoch); rebuilding its entries", worker_id)
                self.index.remove_worker(worker_id)
            st.epoch = epoch
            try:
                batch = decode_batch(fields[b"data"])
                if batch.worker_id != worker_id:
                    raise ValueError(f"batch of worker {batch.worker_id!r} in the stream of {worker_id!r}")
                ok = self.index.apply_batch(batch)
                if ok and self.on_batch is not None:
                    self.on_batch(batch)
            except (KeyError, ValueError) as exc:
                log.warning("malformed entry %s in the stream of %s (%s); resyncing", entry_id, worker_id, exc)
                st.cursor = entry_id  # unreadable: skip it, the snapshot covers it
                self._start_resync(worker_id, st)
                return
            if not ok:
                # Leave the cursor before this entry: it is read again after the snapshot,
                # and skipped as a duplicate if the snapshot covers it.
                self._start_resync(worker_id, st)
                return
            st.cursor = entry_id

    # --------------------------------------------------------------- resync
    def _start_resync(self, worker_id: str, st: _StreamState) -> None:
        address = str(self._live.get(worker_id, {}).get("address", ""))
        st.resync_task = asyncio.get_running_loop().create_task(
            self._resync(worker_id, address, st), name=f"kv-resync-{worker_id}")

    async def _resync(self, worker_id: str, address: str, st: _StreamState) -> None:
        loop = asyncio.get_running_loop()
        try:
            # A stream that still skips a seq right after a snapshot would resync in a
            # tight loop; space back-to-back resyncs of one worker by a poll interval.
            wait = st.last_resync + self.poll_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            seq, blocks = await self._resync_fn(worker_id, address)
            if self._streams.get(worker_id) is st:
                self.index.apply_snapshot(worker_id, int(seq), blocks)
                self.resyncs += 1
                st.failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the callback is an RPC: any failure means "try later"
            self.resync_failures += 1
            st.failures += 1
            delay = min(_BACKOFF_MAX_S, self.poll_interval_s * 2 ** (st.failures - 1))
            st.hold_until = loop.time() + delay
            if self._streams.get(worker_id) is st:
                self.index.remove_worker(worker_id)  # better no entries than stale ones
            log.warning("resync of worker %s at %r failed (%s); retrying in %.1f s",
                        worker_id, address, exc, delay)
        finally:
            st.last_resync = loop.time()
            st.resync_task = None
            self._poll_now.set()  # let the read loop pick the stream up again promptly
