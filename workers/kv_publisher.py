"""Worker side of the KV event plane: event batches to a Redis stream, and a lease.

Redis layout for a cluster named ``C`` (default ``"default"``):

``kvmesh:C:events:<worker_id>`` (stream)
    One entry per event batch, appended with ``XADD ... MAXLEN ~ N``. Fields:
    ``seq`` (decimal batch sequence number, 1, 2, 3, ... per publisher),
    ``epoch`` (random id of the publishing process; a new value means the
    worker restarted with an empty cache and numbering began again at 1) and
    ``data`` (the batch, :func:`cache_store.events.encode_batch`). Each lease beat sets
    the stream's TTL to ``STREAM_IDLE_TTL_S``, so the stream of a worker that is gone
    (a pod replaced under a new name, a fleet scaled down) leaves Redis that long after
    its last beat instead of staying forever.
``kvmesh:C:worker:<worker_id>`` (string, JSON, with a TTL)
    The worker's lease: ``worker_id``, ``address``, the static ``info`` fields
    (``block_size``, ``model_id``, ``max_model_len``, ...), ``load`` (dict of load
    fields), ``kv_seq`` / ``kv_epoch`` (the publisher's last settled batch and epoch,
    see `KVEventPublisher.lease_fields`) and ``ts`` (seconds since the epoch). Rewritten with ``SET ... PX ttl`` every
    heartbeat; the worker counts as alive while the key exists.
``kvmesh:C:workers`` (set)
    Ids of the workers that registered; readers check each one's lease. An id whose
    lease and stream are both gone is removed by the routers' index subscribers
    (`prune_worker_ids`); a worker that comes back adds itself again at its next beat.

Both classes run their Redis I/O on a daemon thread of their own with the
synchronous redis client, so the engine thread never waits on the network.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.cache_store.events import EventBatch, encode_batch

__all__ = [
    "DEFAULT_CLUSTER",
    "stream_key",
    "lease_key",
    "workers_key",
    "KVEventPublisher",
    "WorkerLease",
    "live_lease_holder",
    "prune_worker_ids",
    "STREAM_IDLE_TTL_S",
    "STREAM_MAXLEN",
]

log = logging.getLogger(__name__)

#: Cluster name used when none is given.
DEFAULT_CLUSTER = "default"

#: Approximate cap on a worker's event stream (batches). The stream only has to cover how far
#: a subscriber may fall behind: a router that finds entries trimmed away (or starts after
#: them) resyncs that worker from its snapshot. At a busy worker's ~20 batches a second that
#: is about 100 s of events, and at most ~2,000 x 256 events x ~82 bytes (about 40 MB; a
#: few MB in practice) of Redis memory per worker (docs/DEPLOY.md, Sizing).
STREAM_MAXLEN = 2_000

_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 2.0


def stream_key(worker_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    """Redis stream holding ``worker_id``'s event batches: ``kvmesh:{cluster}:events:{worker_id}``."""
    return f"kvmesh:{cluster}:events:{worker_id}"


def lease_key(worker_id: str, cluster: str = DEFAULT_CLUSTER) -> str:
    """Redis key of ``worker_id``'s lease (JSON string with a TTL): ``kvmesh:{cluster}:worker:{worker_id}``."""
    return f"kvmesh:{cluster}:worker:{worker_id}"


def workers_key(cluster: str = DEFAULT_CLUSTER) -> str:
    """Redis set of every worker id that ever registered: ``kvmesh:{cluster}:workers``."""
    return f"kvmesh:{cluster}:workers"


def _client(redis_url: str) -> redis.Redis:
    # at most two attempts of 2 s per call: a hung Redis must not stretch a worker's shutdown
    return redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                retry=Retry(NoBackoff(), 1))


class KVEventPublisher:
    """Batches a worker's KV events and appends them to its Redis stream.

    ``sink`` is the engine's event callback. A background thread cuts the
    pending events into batches every ``flush_interval_s`` (sooner once
    ``max_batch_events`` are pending), numbers them ``seq = last + 1``
    starting at 1, and appends each with
    ``XADD <stream> MAXLEN ~ stream_maxlen * seq <seq> epoch <epoch> data <batch>``,
    strictly in seq order.

    When Redis is unreachable the thread retries with exponential backoff
    (0.05 s doubling to 2 s) while events keep being batched; at most
    ``max_queued_batches`` wait, and the oldest are dropped beyond that.
    Numbering never goes back, so a dropped batch shows up as a gap to readers,
    who then resync from the worker's snapshot.

    On start the stream is emptied (``XTRIM MAXLEN 0``) before the first append:
    entries of an earlier process with the same worker id describe a cache
    that no longer exists.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        worker_id: this worker's id.
        cluster: cluster name (key prefix).
        flush_interval_s: longest time an event waits before being batched (seconds).
        max_batch_events: most events per batch (events).
        stream_maxlen: approximate cap on stream entries (batches; `STREAM_MAXLEN`).
        max_queued_batches: most batches held while Redis is unreachable (batches).
        instance: this process's lease instance token (`WorkerLease.instance`); with it
            every write to the stream (the first trim, each batch) is one Lua script that
            checks the worker id's lease first and writes nothing while another instance
            holds it: a process that lost its id (`WorkerLease` fencing) cannot trim or
            append to the stream of the process that holds it. The publisher then stops
            (``fenced`` is set) and drops what it held.

    Raises:
        ValueError: a size or interval is not positive.
    """

    def __init__(self, redis_url: str, worker_id: str, cluster: str = DEFAULT_CLUSTER,
                 flush_interval_s: float = 0.05, max_batch_events: int = 256,
                 stream_maxlen: int = STREAM_MAXLEN, max_queued_batches: int = 4096, instance: str | None = None):
        if flush_interval_s <= 0 or max_batch_events < 1 or stream_maxlen < 1 or max_queued_batches < 1:
            raise ValueError("flush_interval_s, max_batch_events, stream_maxlen and max_queued_batches "
                             "must be positive")
        self.worker_id = worker_id
        self.cluster = cluster
        self.stream = stream_key(worker_id, cluster)
        self.epoch = uuid.uuid4().hex
        self.flush_interval_s = flush_interval_s
        self.max_batch_events = max_batch_events
        self.stream_maxlen = stream_maxlen
        self.max_queued_batches = max_queued_batches
        self._redis = _client(redis_url)
        self.instance = instance
        self._lease_key = lease_key(worker_id, cluster)
        self._fenced_write = self._redis.register_script(_FENCED_WRITE) if instance else None
        #: set when a write found another instance's lease: the publisher has stopped
        self.fenced = False
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)   # signalled when batches leave the queue
        self._pending: list = []
        self._queue: collections.deque[tuple[int, float, list]] = collections.deque()
        self._last_seq = 0        # last seq assigned
        self._settled_seq = 0     # every seq <= this was appended or dropped
        self._published = 0
        self._dropped = 0
        self._errors = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-publisher-{worker_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine side
    def sink(self, event) -> None:
        """Queue one KV event (thread-safe, no I/O; called from the engine thread)."""
        with self._lock:
            self._pending.append(event)
            full = len(self._pending) >= self.max_batch_events
        if full:
            self._wake.set()

    def flush_now(self) -> int:
        """Number the pending events now and return the last seq assigned (0 if none yet).

        Every event passed to :meth:`sink` before the call belongs to a batch
        with seq <= the returned value; a snapshot taken together with this
        call therefore reflects exactly batches ``1..seq``. The appends
        themselves happen on the background thread, in seq order.
        """
        with self._lock:
            self._cut_locked()
            seq = self._last_seq
        self._wake.set()
        return seq

    def wait_published(self, timeout: float = 5.0) -> bool:
        """Flush, then wait until every batch numbered so far was appended or dropped.

        Returns:
            True if that happened within ``timeout`` seconds.
        """
        target = self.flush_now()
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._settled_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
        return True

    def lease_fields(self) -> dict:
        """What the worker's lease says of this publisher (thread-safe, no I/O):
        ``kv_seq``, the last batch seq appended to the stream or dropped (every batch
        up to it is settled), and ``kv_epoch``, this process's epoch. A reader whose index
        of this worker is behind ``kv_seq`` with nothing left to read in the stream has
        lost a tail (trimmed, deleted, dropped) and resyncs from the worker's snapshot."""
        with self._lock:
            return {"kv_seq": self._settled_seq, "kv_epoch": self.epoch}

    def stats(self) -> dict:
        """Counters: last_seq, published, dropped (batches), errors (failed Redis calls)."""
        with self._lock:
            return {"last_seq": self._last_seq, "published": self._published,
                    "dropped": self._dropped, "errors": self._errors}

    def abandon(self) -> None:
        """Drop every event not yet appended and publish nothing more (another process
        holds this worker id). `close` afterwards only stops the thread."""
        with self._lock:
            dropped = len(self._queue) + (1 if self._pending else 0)
            self._pending = []
            self._queue.clear()
            self._dropped += dropped
            self._settled_seq = self._last_seq
            self._done.notify_all()
        self._abandoned = True
        self._stop.set()
        self._wake.set()

    _abandoned = False

    def close(self, timeout: float = 2.0) -> None:
        """Flush, wait up to ``timeout`` seconds for the appends, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._abandoned:
            self.wait_published(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout + 1.0)
        if not self._thread.is_alive():  # else it is still in a Redis call: leave it its client
            self._redis.close()

    # ------------------------------------------------------------- internals
    def _cut_locked(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        now = time.time()
        step = self.max_batch_events
        for start in range(0, len(pending), step):
            self._last_seq += 1
            self._queue.append((self._last_seq, now, pending[start:start + step]))
        while len(self._queue) > self.max_queued_batches:
            seq, _, _ = self._queue.popleft()
            self._dropped += 1
            self._settled_seq = max(self._settled_seq, seq)
        self._done.notify_all()

    def _run(self) -> None:
        trimmed = False
        backoff = 0.0
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                if backoff:  # Redis is failing: wait out the backoff even if events pile up
                    self._stop.wait(backoff)
                else:
                    self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            if self._abandoned:
                return
            with self._lock:
                self._cut_locked()
            try:
                if not trimmed:
                    if self._fenced_write is not None:
                        if not self._fenced_write(keys=[self._lease_key, self.stream], args=[self.instance, "trim"]):
                            self._fence()
                            return
                    else:
                        self._redis.xtrim(self.stream, maxlen=0, approximate=False)
                    trimmed = True
                if not self._send_queued():
                    self._fence()
                    return
                backoff = 0.0
            except redis.RedisError as exc:
                with self._lock:
                    self._errors += 1
                backoff = min(_BACKOFF_MAX_S, max(_BACKOFF_START_S, backoff * 2))
                log.warning("kv events for %s not published (%s); retrying in %.2f s",
                            self.worker_id, exc, backoff)
                if stopping:
                    return
                continue
            if stopping:
                return

    def _fence(self) -> None:
        log.error("kv events of %s: another process holds this worker id's lease; this one publishes nothing "
                  "more", self.worker_id)
        self.fenced = True
        self.abandon()

    def _send_queued(self) -> bool:
        """Append the queued batches in order; False (nothing more appended) when fenced."""
        while True:
            if self._abandoned:
                return True
            with self._lock:
                if not self._queue:
                    return True
                seq, ts, events = self._queue[0]
            try:
                data = encode_batch(EventBatch(self.worker_id, seq, ts, events))
            except ValueError as exc:
                log.error("dropping malformed kv event batch %d of %s: %s", seq, self.worker_id, exc)
                data = None
            if data is not None:
                if self._fenced_write is not None:
                    if not self._fenced_write(keys=[self._lease_key, self.stream],
                                              args=[self.instance, "add", str(seq), self.epoch, data,
                                                    self.stream_maxlen]):
                        return False
                else:
                    self._redis.xadd(self.stream, {"seq": str(seq), "epoch": self.epoch, "data": data},
                                     maxlen=self.stream_maxlen, approximate=True)
            with self._lock:
                # The head may have been dropped by an overflow meanwhile.
                if self._queue and self._queue[0][0] == seq:
                    self._queue.popleft()
                if data is None:
                    self._dropped += 1
                else:
                    self._published += 1
                self._settled_seq = max(self._settled_seq, seq)
                self._done.notify_all()


#: Lua: the lease under ``key`` as a table and its raw value (nil, nil when absent or not JSON).
_LEASE_PRELUDE = """
local function lease_at(key)
  local cur = redis.call('GET', key)
  if not cur then return nil, nil end
  local ok, lease = pcall(cjson.decode, cur)
  if ok and type(lease) == 'table' then return lease, cur end
  return nil, cur
end
-- the raw lease when another instance than `instance` holds it, else nil
local function held_by_other(key, instance)
  local lease, cur = lease_at(key)
  if lease and lease['instance'] and lease['instance'] ~= instance then return cur end
  return nil
end
"""
#: Write a lease unless another process holds it. KEYS: lease, workers set, event stream;
#: ARGV: value, TTL (ms), this process's instance token, worker id, the stream's idle TTL
#: (ms). Returns the holder's lease (a string) when another instance wrote the key and it
#: has not lapsed, else writes, pushes the stream's expiry on, and returns false.
_BEAT = _LEASE_PRELUDE + """
local other = held_by_other(KEYS[1], ARGV[3])
if other then return other end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
return false
"""
#: Prefix that lets a script run while Redis is over its maxmemory under ``noeviction``
#: (Redis >= 7.0 script flags; an older Redis refuses the line and the plain script is used).
#: A lease is a few hundred bytes; without it a Redis filled by the remote tier would take
#: every worker out of the routers' view, and the remote tier's collector would then see
#: their namespaces as abandoned.
_ALLOW_OOM = "#!lua flags=allow-oom\n"
#: Remove worker ids whose lease and event stream are both gone from the workers set.
#: KEYS: workers set; ARGV: lease key prefix, stream key prefix, then the ids. Returns
#: the number removed. Checked and removed in one script, so a worker that beats in
#: between keeps its id (its beat re-adds it in any case).
_PRUNE = """
local removed = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('EXISTS', ARGV[1] .. id) == 0 and redis.call('EXISTS', ARGV[2] .. id) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], id)
  end
end
return removed
"""

#: Seconds a worker's event stream outlives its last lease beat (the TTL each beat sets).
#: A stream is read only while its worker's lease is live, and a worker that comes back
#: after this starts a new epoch (or is resynced from its snapshot), so nothing reads it
#: later; the margin covers Redis outages and slow restarts under the same id.
STREAM_IDLE_TTL_S = 600.0


def prune_worker_ids(client, worker_ids, cluster: str = DEFAULT_CLUSTER) -> int:
    """Remove from ``kvmesh:{cluster}:workers`` each of ``worker_ids`` whose lease and
    event stream are both gone (its stream expired ``STREAM_IDLE_TTL_S`` after its last
    beat). Works with a synchronous or an asyncio redis-py client (returns what the
    client's ``eval`` returns: the count removed, or an awaitable of it).

    Raises:
        redis.RedisError: Redis could not be reached.
    """
    return client.eval(_PRUNE, 1, workers_key(cluster), lease_key("", cluster), stream_key("", cluster),
                       *worker_ids)
#: Write to a worker's event stream unless another instance holds its lease. KEYS: lease,
#: stream; ARGV: instance token, "trim" | "add", then for "add": seq, epoch, data, maxlen.
#: Returns 1 when written, 0 when fenced.
_FENCED_WRITE = _LEASE_PRELUDE + """
if held_by_other(KEYS[1], ARGV[1]) then return 0 end
if ARGV[2] == 'trim' then
  redis.call('XTRIM', KEYS[2], 'MAXLEN', 0)
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'seq', ARGV[3], 'epoch', ARGV[4], 'data', ARGV[5])
end
return 1
"""
#: Delete a lease only if this instance holds it. KEYS: lease; ARGV: instance token.
_RELEASE = _LEASE_PRELUDE + """
local lease = lease_at(KEYS[1])
if lease and lease['instance'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


#: Seconds between warnings while a worker's lease cannot be renewed (Redis down).
LEASE_WARN_EVERY_S = 30.0


class WorkerLease:
    """Keeps a worker's lease key alive in Redis from a heartbeat thread.

    Every ``interval_s`` it writes ``kvmesh:{cluster}:worker:{worker_id}`` =
    JSON ``{**info, "worker_id", "address", "instance", "load": load_fn(), "ts"}``
    with ``SET ... PX ttl_s*1000`` and adds the id to ``kvmesh:{cluster}:workers``.
    If the worker stops beating, readers see the key vanish after ``ttl_s``.
    Redis errors and ``load_fn`` errors are logged and retried on the next
    beat (the last good load is reused). The beat runs even while Redis is over its
    ``maxmemory`` under ``noeviction`` (an ``allow-oom`` script, Redis >= 7.0): a Redis
    filled by KV records must not take every worker out of the routers' view.

    **Fencing.** ``instance`` is a random token of this process. A beat (one Lua script)
    does not overwrite a lease another instance wrote and that has not lapsed: two
    processes under one worker id (started at the same moment, or one that lost Redis
    for longer than ``ttl_s`` while a replacement took its id) would otherwise interleave
    their leases and event streams. The beat that finds one stops the heartbeat and calls
    ``on_lost(holder_lease)`` once; closing deletes the key only while this instance holds it.

    Args:
        redis_url: Redis URL.
        worker_id: worker id.
        address: gRPC address routers dial (host:port).
        info: static fields, e.g. ``block_size``, ``model_id``, ``num_blocks``.
        load_fn: returns the current load fields (e.g. ``Engine.load``).
        cluster: cluster name.
        ttl_s: lease lifetime without a heartbeat (seconds).
        interval_s: heartbeat period (seconds), below ``ttl_s``.
        fields_fn: optional; returns more fields for each beat (e.g.
            `KVEventPublisher.lease_fields`: ``kv_seq``, ``kv_epoch``).
        on_lost: optional; called once (from the heartbeat thread) with the other
            process's lease (a dict; ``address`` says where it runs) when a beat finds that
            another instance holds this worker id's lease.
        instance: this process's token (default: a new random one); give the same to its
            `KVEventPublisher` so that its stream writes are fenced too.
        stream_idle_ttl_s: the TTL (seconds) each beat gives the worker's event stream
            (``kvmesh:{cluster}:events:{worker_id}``), so a gone worker's stream expires.

    Raises:
        ValueError: ``interval_s`` is not in ``(0, ttl_s)``, or ``stream_idle_ttl_s`` is
            not above ``ttl_s``.
    """

    def __init__(self, redis_url: str, worker_id: str, address: str, info: dict,
                 load_fn: Callable[[], dict], cluster: str = DEFAULT_CLUSTER,
                 ttl_s: float = 3.0, interval_s: float = 1.0,
                 fields_fn: Callable[[], dict] | None = None,
                 on_lost: Callable[[dict], None] | None = None, instance: str | None = None,
                 stream_idle_ttl_s: float = STREAM_IDLE_TTL_S):
        if not 0 < interval_s < ttl_s:
            raise ValueError("interval_s must be positive and below ttl_s")
        if not stream_idle_ttl_s > ttl_s:
            raise ValueError("stream_idle_ttl_s must be above ttl_s")
        self.worker_id = worker_id
        self.address = address
        self.info = dict(info)
        self.load_fn = load_fn
        self.fields_fn = fields_fn
        self.key = lease_key(worker_id, cluster)
        self.set_key = workers_key(cluster)
        self.stream_key = stream_key(worker_id, cluster)
        self.stream_idle_ttl_s = stream_idle_ttl_s
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.instance = instance or uuid.uuid4().hex
        self.on_lost = on_lost
        #: the other process's lease once a beat found one (the heartbeat has stopped)
        self.lost_to: dict | None = None
        self._redis = _client(redis_url)
        self._beat_scripts = [self._redis.register_script(_ALLOW_OOM + _BEAT), self._redis.register_script(_BEAT)]
        self._release_script = self._redis.register_script(_RELEASE)
        self._load: dict = {}
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"worker-lease-{worker_id}", daemon=True)
        self._thread.start()

    def lease_value(self) -> dict:
        """The lease contents the next heartbeat writes (calls ``load_fn``)."""
        try:
            self._load = dict(self.load_fn())
        except Exception:  # the load callback belongs to the engine; never kill the heartbeat
            log.exception("load_fn of worker %s failed; reusing the last load", self.worker_id)
        extra = {}
        if self.fields_fn is not None:
            try:
                extra = dict(self.fields_fn())
            except Exception:
                log.exception("fields_fn of worker %s failed; lease written without its fields", self.worker_id)
        return {**self.info, **extra, "worker_id": self.worker_id, "address": self.address,
                "instance": self.instance, "load": self._load, "ts": time.time()}

    def beat(self) -> bool:
        """Write the lease once, now (the thread does this every ``interval_s``). Returns
        False, writing nothing, when another instance holds the lease (see ``lost_to``).

        Raises:
            redis.RedisError: Redis could not be reached.
        """
        value = json.dumps(self.lease_value(), separators=(",", ":"))
        keys = [self.key, self.set_key, self.stream_key]
        args = [value, int(self.ttl_s * 1000), self.instance, self.worker_id, int(self.stream_idle_ttl_s * 1000)]
        while True:
            try:
                holder = self._beat_scripts[0](keys=keys, args=args)
                break
            except redis.ResponseError as exc:
                if isinstance(exc, redis.exceptions.OutOfMemoryError) or len(self._beat_scripts) == 1:
                    raise
                # a Redis before 7.0 knows no script flags: beat with the plain script from now on
                log.debug("lease of %s: flagged script refused (%s); using the plain one", self.worker_id, exc)
                self._beat_scripts = self._beat_scripts[1:]
        if not holder:
            return True
        try:
            lease = json.loads(holder)
            self.lost_to = lease if isinstance(lease, dict) else {}
        except (ValueError, TypeError):
            self.lost_to = {}
        return False

    def _run(self) -> None:
        failed, said_at = 0, None  # failed beats in a row; when the last warning went out
        while not self._stop.is_set():
            try:
                ok = self.beat()
                if failed:
                    log.warning("lease of %s renewed again after %d failed attempt(s)", self.worker_id, failed)
                    failed, said_at = 0, None
                if not ok:
                    log.error("worker id %s: another process (instance %s at %s) holds its lease; this one "
                              "(%s) stops renewing it", self.worker_id, self.lost_to.get("instance", "?"),
                              self.lost_to.get("address", "?"), self.address)
                    if self.on_lost is not None:
                        try:
                            self.on_lost(dict(self.lost_to))
                        except Exception:  # noqa: BLE001 - the callback is the worker's
                            log.exception("on_lost of worker %s failed", self.worker_id)
                    return
            except redis.RedisError as exc:
                failed += 1
                now = time.monotonic()
                if said_at is None or now - said_at >= LEASE_WARN_EVERY_S:  # one line per 30 s, not per beat
                    log.warning("lease of %s not renewed (%d attempt(s) so far): %s", self.worker_id, failed, exc)
                    said_at = now
            self._stop.wait(self.interval_s)

    def close(self, delete: bool = True) -> None:
        """Stop beating and, if ``delete``, delete the lease key (best effort);
        otherwise it lapses after ``ttl_s``, as when the worker dies. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5.0)
        if delete:
            try:
                self._release_script(keys=[self.key], args=[self.instance])  # never another instance's lease
            except redis.RedisError as exc:
                log.warning("lease of %s not deleted (expires by itself): %s", self.worker_id, exc)
        if not self._thread.is_alive():
            self._redis.close()


def live_lease_holder(redis_url: str, worker_id: str, cluster: str = DEFAULT_CLUSTER, ttl_s: float = 3.0,
                      interval_s: float = 1.0, poll_s: float = 0.1) -> dict | None:
    """The lease of another live process using ``worker_id`` in ``cluster``, or None.

    A lease left by a worker that died (or was stopped without deleting it) lapses within
    ``ttl_s`` and is never renewed; a live worker rewrites it every ``interval_s``. So the
    key is watched until it vanishes (None: the id is free) or is rewritten (its value, a
    dict with ``address``: the id is in use). Takes at most ``ttl_s + interval_s`` seconds,
    none when no lease exists. Blocking.

    Raises:
        redis.RedisError: Redis could not be reached.
    """
    r = _client(redis_url)
    try:
        key = lease_key(worker_id, cluster)
        first = r.get(key)
        if first is None:
            return None
        deadline = time.monotonic() + ttl_s + interval_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            now = r.get(key)
            if now is None:
                return None
            if now != first:
                try:
                    return dict(json.loads(now))
                except (ValueError, TypeError):
                    return {"address": "?"}
        return None  # never rewritten: a lapsing lease (its TTL is Redis's business)
    finally:
        r.close()


class LeaseCheck:
    """Whether a worker id holds a current lease at a given address (peer-fetch trust).

    Only writers holding the cluster's Redis credentials can write a lease, so a holder
    named in ``prefix_location`` that has no lease here is not part of the cluster.
    Callable ``(worker_id, address) -> bool``; blocking (call from a thread).

    Raises:
        redis.RedisError: Redis could not be reached.
    """

    def __init__(self, redis_url: str, cluster: str = DEFAULT_CLUSTER):
        self._redis = _client(redis_url)
        self.cluster = cluster

    def __call__(self, worker_id: str, address: str) -> bool:
        if not worker_id:
            return False
        raw = self._redis.get(lease_key(worker_id, self.cluster))
        if raw is None:
            return False
        try:
            lease = json.loads(raw)
        except ValueError:
            return False
        return isinstance(lease, dict) and lease.get("address") == address

    def close(self) -> None:
        self._redis.close()
