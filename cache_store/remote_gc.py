"""Garbage collection of the remote tier's abandoned namespaces.

The remote tier keeps each KV producer's records apart (:mod:`cache_store.remote_tier`):
``kvmesh:C.TAG:`` (``.kID`` appended with a record key), where ``TAG`` is the producer
tag that each worker's lease names in ``kv_producer`` (`workers.model_identity.producer_tag`).
Workers from before KV producers used the untagged namespace ``kvmesh:C:`` (their leases
carry no ``kv_producer``). When a fleet moves to another producer (a new torch, another
``--threads``, a kvmesh version that changed the producer string), the old namespace is
never read, evicted or expired again: its keys hold Redis memory for good, and under
``maxmemory`` with ``noeviction`` they end up refusing the new namespace's puts.

`RemoteGC` deletes such a namespace once no live lease of the cluster has named its tag for
``grace_s`` seconds. What counts as one namespace's "seen unnamed" time:

* a pass (at most one per cluster at a time, under a Redis lock) lists the live leases
  (``kvmesh:C:workers`` and each ``kvmesh:C:worker:ID``) and the namespaces present (SCAN
  for their bookkeeping keys), and records, per namespace that no lease names, when a pass
  first saw it so and its ``kv-clock`` value then (hash ``kvmesh:C:remote-gc``, times from
  Redis's own clock, so the workers' clocks need not agree);
* the record starts over when a lease names the tag again, when ``kv-clock`` moved (some
  process still reads or writes the namespace, with a lease or without one), or when no pass
  saw the namespace for more than twice the grace (the collector was off or every worker
  was down: nothing is known of that time);
* once a pass finds the record ``grace_s`` old, the namespace is deleted: its block keys in
  ``UNLINK`` batches, then its bookkeeping keys; leases and ``kv-clock`` are read again
  before the deletion and every few seconds during it, and a tag named again (or a clock
  that moved) stops it.

Only remote-tier keys are deleted: ``kv:H`` (H 32 hex digits), ``kv-lru``, ``kv-lru:T``,
``kv-owner``, ``kv-tbytes``, ``kv-bytes``, ``kv-len``, ``kv-clock`` and ``kv-cap`` under the
namespace's prefix. Leases, event streams, rate-limit counters and every other key under
``kvmesh:C:`` are never touched, nor are other clusters' keys: a namespace name that is
itself a cluster (``kvmesh:C.X:workers`` exists: a cluster named ``C.X``) is left alone. A
namespace of a live tag is kept whatever its record key id (leases do not name the key), so
the records of a rotated-out record key are not collected.

Load on Redis: every Redis call is bounded (``SCAN ... COUNT scan_count``, ``UNLINK`` of at
most ``unlink_batch`` keys, ``MGET`` of at most 500 leases), with ``pause_s`` between calls,
and ``UNLINK`` frees memory on Redis's background thread. A pass walks the keyspace once
with SCAN (1,000 calls per million keys), more only when it deletes. The passes run on
their own daemon thread (``kvmesh-remote-gc``), never on a request path or a control-plane
thread, with their own Redis connection.

Lock: ``SET kvmesh:C:remote-gc-lock TOKEN NX PX ttl``, renewed during a pass and released
with a compare-and-delete script (the single-instance lock of the Redis documentation). A
pass that loses the lock (paused longer than its TTL) stops at its next Redis call. Two
passes at once could still only delete the same abandoned namespace twice: the lock saves
work, the grace rules keep data safe.

A full Redis: under ``maxmemory`` with ``noeviction`` Redis refuses commands that may add
memory, which is when the collector is needed most. ``UNLINK``, ``HDEL`` and the reads are
always allowed; the collector's own writes of a few bytes (the lock, its record, the mark
of a pass) run as Lua scripts flagged ``allow-oom`` (Redis 7.0 and later; an older Redis
runs them unflagged, and a pass on a full one fails until memory is freed).

Errors: a Redis error ends the pass (the next one starts over), is logged at WARNING at
most once per ``ERROR_LOG_EVERY_S`` seconds, and never leaves the thread; a Redis that is
down costs one failed connection per pass.
"""
from __future__ import annotations

import json
import logging
import math
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import redis

from kvmesh.cache_store.tier_config import glob_escape as _glob_escape


__all__ = [
    "DEFAULT_GRACE_S",
    "MIN_GRACE_S",
    "RemoteGC",
    "PassResult",
    "gc_lock_key",
    "gc_recent_key",
    "gc_state_key",
]

log = logging.getLogger(__name__)

#: Default grace (seconds): how long no live lease may name a producer tag before its
#: namespace is deleted (``--remote-gc-grace-s``). A restart or a rolling upgrade keeps
#: some lease of the tag alive or lapses it for seconds (leases live 3 s); ten minutes also
#: covers a whole producer group being rescheduled (a node drain, a crash loop at its
#: longest back-off of 5 minutes) or an upgrade rolled back soon after.
DEFAULT_GRACE_S = 600.0
#: Shortest grace the worker flag accepts (seconds); the class takes any positive value.
MIN_GRACE_S = 60.0
#: Longest wait between two passes of a worker (seconds); shorter for a short grace.
DEFAULT_INTERVAL_S = 60.0
#: Lifetime of the pass lock without renewal (seconds); a pass renews it at a third of that.
LOCK_TTL_S = 60.0
#: Keys Redis walks per SCAN call.
SCAN_COUNT = 1000
#: Keys per UNLINK call.
UNLINK_BATCH = 500
#: Pause between two Redis calls of a pass (seconds).
PAUSE_S = 0.02
#: Leases and ``kv-clock`` are read again at least this often while deleting (seconds).
RECHECK_S = 2.0
#: Leases per MGET.
_LEASE_CHUNK = 500
#: At most one warning per this many seconds about failed passes.
ERROR_LOG_EVERY_S = 300.0
#: Socket timeout of the collector's own Redis connection (seconds).
CLIENT_TIMEOUT_S = 5.0

_META = r"kv-(?:lru(?::.+)?|owner|tbytes|bytes|len|clock|cap)"
# renew / release the lock only while it holds this pass's token
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# The collector's own writes of a few bytes. A Redis over its maxmemory under noeviction
# refuses SET and HSET, and that is when the collector is needed most: these run as scripts
# flagged allow-oom (Redis >= 7.0); an older Redis, which knows no script flags, runs them
# unflagged, as plain commands would.
_ALLOW_OOM = "#!lua flags=allow-oom\n"
_ACQUIRE = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])"  # the lock
_MARK = "return redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])"  # a pass just ended
_RECORD = "for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end return #ARGV / 2"


def gc_lock_key(cluster: str) -> str:
    """The lock one pass of the cluster holds: ``kvmesh:{cluster}:remote-gc-lock``."""
    return f"kvmesh:{cluster}:remote-gc-lock"


def gc_recent_key(cluster: str) -> str:
    """Set when a pass ends, for 80 % of its ``interval_s``: while it exists no other pass of
    the cluster starts, so a fleet of N workers makes about one pass per interval, not N:
    ``kvmesh:{cluster}:remote-gc-recent``."""
    return f"kvmesh:{cluster}:remote-gc-recent"


def gc_state_key(cluster: str) -> str:
    """Hash of the namespaces seen unnamed, field = namespace (``C`` or ``C.TAG[.kID]``),
    value = JSON ``{"first": ms, "last": ms, "clock": kv-clock}`` (Redis ``TIME``):
    ``kvmesh:{cluster}:remote-gc``."""
    return f"kvmesh:{cluster}:remote-gc"


class _Stop(Exception):
    """The pass ends early: the collector is stopping, or it lost the lock."""


@dataclass
class PassResult:
    """What one `RemoteGC.run_once` did.

    Attributes:
        ran: whether this call held the lock and went through the pass (False: another
            pass holds the lock, one of the cluster ended less than ``0.8 * interval_s``
            ago, this object is in a pass already, or Redis failed before it started).
        deleted: keys deleted per namespace (``C.TAG``, ``C`` for the untagged one).
        waiting: seconds of grace left per namespace seen unnamed and not yet due.
        error: why the pass ended early ("" when it did not).
    """

    ran: bool = False
    deleted: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)
    error: str = ""


class RemoteGC:
    """Deletes the remote-tier namespaces of a cluster that no live lease names (module doc).

    Args:
        client: a synchronous ``redis.Redis`` with ``decode_responses=False`` and a socket
            timeout; the collector's own (closed by `stop` when ``owns_client``).
        cluster: the cluster name (``--cluster``), without producer tag.
        grace_s: seconds a namespace's tag must go unnamed by every live lease, seen so by
            passes, before its keys are deleted; > 0.
        keep: namespaces never deleted, e.g. this worker's own (``RemoteTier.cluster``); their
            producer tags count as named.
        interval_s: seconds between the end of one pass and the start of the next on the
            thread (±20 % at random); default ``min(60, grace_s / 4)``.
        scan_count: SCAN's COUNT, >= 1. unlink_batch: keys per UNLINK, >= 1.
        pause_s: seconds between two Redis calls of a pass, >= 0.
        lock_ttl_s: seconds the pass lock lives without renewal, > 0.
        on_deleted: called with each namespace's count of deleted keys (e.g. the tier's
            ``remote_gc_deleted`` counter).
        owns_client: close ``client`` in `stop`.

    Raises:
        ValueError: a value out of its range above.
    """

    def __init__(self, client: redis.Redis, cluster: str, *, grace_s: float = DEFAULT_GRACE_S,
                 keep: tuple[str, ...] | list[str] = (), interval_s: float | None = None,
                 scan_count: int = SCAN_COUNT, unlink_batch: int = UNLINK_BATCH, pause_s: float = PAUSE_S,
                 lock_ttl_s: float = LOCK_TTL_S, on_deleted: Callable[[int], None] | None = None,
                 owns_client: bool = False):
        if not (math.isfinite(grace_s) and grace_s > 0):
            raise ValueError(f"grace_s must be a finite number of seconds > 0, got {grace_s!r}")
        if interval_s is None:
            interval_s = min(DEFAULT_INTERVAL_S, grace_s / 4)
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a finite number of seconds > 0, got {interval_s!r}")
        if scan_count < 1 or unlink_batch < 1:
            raise ValueError(f"scan_count and unlink_batch must be >= 1, got {scan_count} and {unlink_batch}")
        if not (math.isfinite(pause_s) and pause_s >= 0):
            raise ValueError(f"pause_s must be a finite number of seconds >= 0, got {pause_s!r}")
        if not (math.isfinite(lock_ttl_s) and lock_ttl_s > 0):
            raise ValueError(f"lock_ttl_s must be a finite number of seconds > 0, got {lock_ttl_s!r}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the remote tier's collector needs a redis client with decode_responses=False")
        self.client = client
        self.cluster = cluster
        self.grace_s = float(grace_s)
        self.interval_s = float(interval_s)
        self.scan_count = int(scan_count)
        self.unlink_batch = int(unlink_batch)
        self.pause_s = float(pause_s)
        self.lock_ttl_s = float(lock_ttl_s)
        self.on_deleted = on_deleted
        self.owns_client = owns_client
        self.lock_key = gc_lock_key(cluster)
        self.recent_key = gc_recent_key(cluster)
        self.state_key = gc_state_key(cluster)
        self._keep = {ns for ns in keep}
        self._keep_tags = {_tag_of(ns[len(cluster):]) for ns in self._keep if ns == cluster
                           or ns.startswith(cluster + ".")}
        c = re.escape(cluster.encode())
        # bookkeeping keys of the cluster's namespaces; group 1 = "" or ".TAG" / ".TAG.kID" / ".kID"
        self._meta_re = re.compile(rb"kvmesh:" + c + rb"((?:\.[0-9a-f]{8})?(?:\.k[0-9a-f]{8})?):"
                                   + _META.encode() + rb"\Z", re.S)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._writes = {name: (client.register_script(_ALLOW_OOM + body), client.register_script(body))
                        for name, body in (("acquire", _ACQUIRE), ("mark", _MARK), ("record", _RECORD))}
        self._flagged = True  # False once Redis refused a flagged script (before 7.0)
        self._token = ""
        self._renewed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = threading.Lock()  # one pass per object at a time
        self._said_at: float | None = None  # when the last warning went out
        self._unsaid = 0  # failures not logged since

    @classmethod
    def for_tier(cls, tier, url: str, cluster: str, grace_s: float = DEFAULT_GRACE_S, **kw) -> RemoteGC:
        """A collector for a worker's `RemoteTier` on Redis ``url``: its own connection
        (``CLIENT_TIMEOUT_S`` socket timeout, no retry), the tier's namespace kept, deletions
        counted in the tier's ``remote_gc_deleted``.

        Raises:
            ValueError: as the constructor; a malformed ``url``.
        """
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(url, socket_timeout=CLIENT_TIMEOUT_S, socket_connect_timeout=CLIENT_TIMEOUT_S,
                                      retry=Retry(NoBackoff(), 0))
        return cls(client, cluster, grace_s=grace_s, keep=(tier.cluster,),
                   on_deleted=lambda n: tier._count(remote_gc_deleted=n), owns_client=True, **kw)

    # -- the thread --------------------------------------------------------------------
    def start(self) -> None:
        """Run passes on a daemon thread until `stop`: the first after a random part of
        ``interval_s`` (workers started together do not all try at once), then every
        ``interval_s`` (±20 %) after the previous one ends."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvmesh-remote-gc", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (a pass in progress ends at its next pause and releases the
        lock); waits at most ``timeout`` seconds. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.owns_client and (self._thread is None or not self._thread.is_alive()):
            self.client.close()

    def _run(self) -> None:
        delay = self.interval_s * random.uniform(0.2, 1.0)
        while not self._stop.wait(delay):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - never let the collector take the worker down
                self._failed("pass failed", exc, traceback=True)
            delay = self.interval_s * random.uniform(0.8, 1.2)

    # -- one pass ----------------------------------------------------------------------
    def run_once(self, force: bool = False) -> PassResult:
        """One pass, now, in the calling thread (blocking; seconds to minutes on a large
        keyspace, see the module doc): take the lock or return, find the namespaces no live
        lease names, record them, delete those seen so for ``grace_s``.

        Args:
            force: run even when another pass of the cluster ended less than
                ``0.8 * interval_s`` ago (the lock is still needed).

        Returns:
            what the pass did. Redis errors are not raised: they end the pass, are logged
            (rate-limited) and given in ``error``.
        """
        res = PassResult()
        if not self._busy.acquire(blocking=False):
            return res  # this object's thread (or another caller) is in a pass
        try:
            self._locked_pass(res, force)
        finally:
            self._busy.release()
        return res

    def _locked_pass(self, res: PassResult, force: bool) -> None:
        token = uuid.uuid4().hex
        try:
            if not self._write("acquire", self.lock_key, token, self._ttl_ms()):
                return  # another worker's pass
        except redis.RedisError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            self._failed("skipping this pass", exc)
            return
        self._token, self._renewed = token, time.monotonic()
        try:
            if not force and self.client.exists(self.recent_key):
                return  # the cluster had its pass for this interval
            res.ran = True
            self._pass(res)
            self._write("mark", self.recent_key, max(1, int(self.interval_s * 800)))
        except _Stop as exc:
            res.error = str(exc)
            if str(exc) != "stopping":
                log.warning("remote tier GC (%s): %s", self.cluster, exc)
        except redis.RedisError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            self._failed("pass ended early", exc)
        finally:
            try:
                self._release(keys=[self.lock_key], args=[token])
            except redis.RedisError:
                pass  # it lapses within lock_ttl_s
            self._token = ""

    def _pass(self, res: PassResult) -> None:
        now = self._now_ms()
        named = self._named_tags()
        if named is None:
            res.error = "a live lease is not readable"
            return
        found = self._namespaces()
        state = self._state()
        grace_ms = self.grace_s * 1000.0
        seen: dict[str, dict] = {}
        due: list[str] = []
        for ns in sorted(found):
            if ns in self._keep or _tag_of(ns[len(self.cluster):]) in named or self._is_cluster(ns):
                continue
            clock = self._clock(ns)
            st = state.get(ns)
            if st is None or st.get("clock") != clock or now - float(st.get("last", 0)) > 2 * grace_ms:
                if st is None:
                    log.info("remote tier GC (%s): no live lease names the KV producer of namespace kvmesh:%s: "
                             "(tag %s); deleting its keys after %g s unless a worker of it comes back",
                             self.cluster, ns, _tag_of(ns[len(self.cluster):]) or "none, from before producers",
                             self.grace_s)
                st = {"first": now, "last": now, "clock": clock}
            else:
                st["last"] = now
            seen[ns] = st
            if now - float(st["first"]) >= grace_ms:
                due.append(ns)
            else:
                res.waiting[ns] = (grace_ms - (now - float(st["first"]))) / 1000.0
        if seen:
            self._write("record", self.state_key,
                        *(x for ns, st in seen.items() for x in (ns, json.dumps(st, separators=(",", ":")))))
        gone = [ns for ns in state if ns not in seen]
        if gone:
            self.client.hdel(self.state_key, *gone)
        for ns in due:
            self._pause()
            n = self._delete(ns, seen[ns])
            if n is not None:
                res.deleted[ns] = n

    def _delete(self, ns: str, st: dict) -> int | None:
        """Delete namespace ``ns``'s remote-tier keys; None when a last check found it in use."""
        tag = _tag_of(ns[len(self.cluster):])
        if not self._unused(ns, tag, st):
            return None
        prefix = f"kvmesh:{ns}:".encode()
        key_re = re.compile(re.escape(prefix) + rb"(?:kv:[0-9a-f]{32}|" + _META.encode() + rb")\Z", re.S)
        deleted, blocks, meta = 0, [], []
        checked = time.monotonic()

        def unlink(keys: list[bytes]) -> int:
            n = int(self.client.unlink(*keys))
            self._pause()
            return n

        try:
            for key in self._scan(_glob_escape(f"kvmesh:{ns}:") + "kv*"):
                if not key_re.match(key):
                    continue
                (blocks if key[len(prefix):].startswith(b"kv:") else meta).append(key)
                if len(blocks) >= self.unlink_batch:
                    deleted += unlink(blocks)
                    blocks = []
                    if time.monotonic() - checked >= RECHECK_S:
                        if not self._unused(ns, tag, st):
                            return self._interrupted(ns, deleted)
                        checked = time.monotonic()
            if blocks:
                deleted += unlink(blocks)
            if not self._unused(ns, tag, st):  # the bookkeeping goes last, and only if still unused
                return self._interrupted(ns, deleted)
            for i in range(0, len(meta), self.unlink_batch):
                deleted += unlink(meta[i:i + self.unlink_batch])
            self.client.hdel(self.state_key, ns)
        finally:
            if deleted and self.on_deleted is not None:
                self.on_deleted(deleted)
        log.info("remote tier GC (%s): deleted %d key(s) of namespace kvmesh:%s: (producer tag %s), named by no "
                 "live lease for %.1f s", self.cluster, deleted, ns, tag or "none, from before producers",
                 (self._now_ms() - float(st["first"])) / 1000.0)
        return deleted

    def _interrupted(self, ns: str, deleted: int) -> int:
        log.info("remote tier GC (%s): stopped deleting namespace kvmesh:%s: after %d key(s): a live lease names "
                 "its producer again, or its tier was used meanwhile", self.cluster, ns, deleted)
        return deleted

    def _unused(self, ns: str, tag: str, st: dict) -> bool:
        named = self._named_tags()
        return named is not None and tag not in named and self._clock(ns) == st.get("clock")

    # -- Redis reads ---------------------------------------------------------------------
    def _named_tags(self) -> set[str] | None:
        """Producer tags named by the cluster's live leases ("" for a lease without
        ``kv_producer``: the untagged namespace), plus those of ``keep``; None when a lease
        cannot be read (nothing is deleted then)."""
        from kvmesh.workers.kv_publisher import lease_key, workers_key
        from kvmesh.workers.model_identity import producer_tag

        ids = sorted(m.decode("utf-8", "surrogateescape") for m in self.client.smembers(workers_key(self.cluster)))
        tags = set(self._keep_tags)
        for i in range(0, len(ids), _LEASE_CHUNK):
            chunk = ids[i:i + _LEASE_CHUNK]
            for wid, raw in zip(chunk, self.client.mget([lease_key(w, self.cluster) for w in chunk])):
                if raw is None:
                    continue
                try:
                    lease = json.loads(raw)
                except ValueError:
                    lease = None
                producer = lease.get("kv_producer") if isinstance(lease, dict) else None
                if not isinstance(lease, dict) or not isinstance(producer, (str, type(None))):
                    self._failed(f"the lease of worker {wid[:80]!r} is not readable; deleting nothing this pass",
                                 None)
                    return None
                tags.add(producer_tag(producer) if producer else "")
        return tags

    def _namespaces(self) -> set[str]:
        """The cluster's remote-tier namespaces (``C``, ``C.TAG``, ...) that have bookkeeping keys."""
        out: set[str] = set()
        for key in self._scan(_glob_escape(f"kvmesh:{self.cluster}") + "[.:]*kv-*"):
            m = self._meta_re.match(key)
            if m:
                out.add(self.cluster + m.group(1).decode("ascii"))
        return out

    def _is_cluster(self, ns: str) -> bool:
        """Whether ``ns``, or a name between the cluster's and it, is a cluster of its own (has
        a workers set): its keys are that cluster's, not a namespace of this one."""
        from kvmesh.workers.kv_publisher import workers_key

        parts = ns[len(self.cluster):].split(".")[1:]
        names = [self.cluster + "".join("." + p for p in parts[:i]) for i in range(1, len(parts) + 1)]
        return bool(names) and int(self.client.exists(*(workers_key(n) for n in names))) > 0

    def _clock(self, ns: str) -> str:
        v = self.client.get(f"kvmesh:{ns}:kv-clock")
        return "" if v is None else v.decode("ascii", "replace")

    def _state(self) -> dict[str, dict]:
        out = {}
        for k, v in self.client.hgetall(self.state_key).items():
            try:
                st = json.loads(v)
            except ValueError:
                st = None
            if isinstance(st, dict) and isinstance(st.get("first"), (int, float)):
                out[k.decode("utf-8", "surrogateescape")] = st
        return out

    def _scan(self, match: str) -> Iterator[bytes]:
        cursor = 0
        while True:
            cursor, keys = self.client.scan(cursor=cursor, match=match, count=self.scan_count)
            yield from keys
            if int(cursor) == 0:
                return
            self._pause()

    def _write(self, name: str, key: str, *args):
        """Run write script ``name`` on ``key``, flagged allow-oom where Redis knows flags."""
        flagged, plain = self._writes[name]
        if self._flagged:
            try:
                return flagged(keys=[key], args=list(args))
            except redis.ResponseError as exc:
                if isinstance(exc, redis.exceptions.OutOfMemoryError):
                    raise
                self._flagged = False  # no script flags before Redis 7.0; a real error recurs below
                log.debug("remote tier GC (%s): flagged script refused (%s); using plain ones", self.cluster, exc)
        return plain(keys=[key], args=list(args))

    def _now_ms(self) -> float:
        sec, usec = self.client.time()
        return sec * 1000.0 + usec / 1000.0

    # -- pacing, lock, logging ---------------------------------------------------------------
    def _ttl_ms(self) -> int:
        return max(1, int(self.lock_ttl_s * 1000))

    def _pause(self) -> None:
        """Wait ``pause_s`` between Redis calls; renew the lock when a third of its TTL went by.

        Raises:
            _Stop: `stop` was called, or the lock is no longer this pass's.
        """
        if self._stop.wait(self.pause_s):
            raise _Stop("stopping")
        if time.monotonic() - self._renewed >= self.lock_ttl_s / 3:
            if not int(self._renew(keys=[self.lock_key], args=[self._token, self._ttl_ms()])):
                raise _Stop(f"lost the lock {self.lock_key} (the pass outlived its {self.lock_ttl_s:g} s TTL); "
                            "ending the pass")
            self._renewed = time.monotonic()

    def _failed(self, what: str, exc: Exception | None, traceback: bool = False) -> None:
        """A WARNING at most once per ``ERROR_LOG_EVERY_S``, counting those left out."""
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < ERROR_LOG_EVERY_S:
            self._unsaid += 1
            return
        more = f" ({self._unsaid} more failed pass(es) not logged)" if self._unsaid else ""
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        log.warning("remote tier GC (%s): %s%s%s", self.cluster, what, why, more,
                    exc_info=exc if traceback else None)
        self._said_at, self._unsaid = now, 0


def _tag_of(suffix: str) -> str:
    """The producer tag of a namespace suffix: ``.TAG`` or ``.TAG.kID`` -> TAG; ``""`` or
    ``.kID`` (untagged) -> ""."""
    first = suffix[1:].split(".", 1)[0] if suffix.startswith(".") else ""
    return "" if first.startswith("k") else first
