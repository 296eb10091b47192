"""In-flight load shared between router replicas through Redis.

Each router knows exactly what it has sent to each worker and not yet seen answered, and
how many requests it routed there recently (`policies.RoutedShare`). With several
replicas, each sees only its own part: a burst of requests sharing one prefix, spread
over K routers, lets each router send its whole part to the holder, so the holder's share
grows with K. `SharedLoad` publishes this router's per-worker counts and reads the
other replicas' before every routing decision, so a policy sees cluster-wide in-flight
load and routed share.

Speculative placements are shared too: a router that just sent a prefix to a worker
treats that worker as holding it for a couple of seconds (`ClusterIndex.add_speculative`);
the other replicas learn of it from the placement's *checkpoints*, the chained block
hashes at positions 1, 2, 4, 8, ... and the last (O(log n) hashes per request). Because
block ``i``'s hash covers every block before it, a request whose hash at position ``p``
equals a checkpoint shares the whole ``p``-block prefix (`matched_prefix`).

Redis layout (cluster ``C``): one hash ``kvmesh:C:router-load``; field = router id, value
= JSON ``{"ts": seconds since the epoch, "w": {worker_id: [running, prefill_tokens,
routed]}, "s": [[worker_id, expiry (epoch seconds), [[position, hash hex], ...]], ...]}``. A router rewrites its own field after each change (one ``HSET``); readers
take every other field in one ``HGETALL`` and ignore (and delete) fields older than
``stale_s``, so a crashed router's counts vanish on their own.

Redis trouble never blocks routing for more than one ``timeout_s``: each call is bounded by
it, and after a read fails routing uses "no shared load" without waiting on Redis again.
Redis is not asked for ``COOLDOWN_S`` seconds, then one read at a time is tried in the
background (a probe) until one answers; only then do decisions read it again. A hung Redis
therefore costs one request one ``timeout_s``, not one per cooldown (logged at most once per
``LOG_EVERY_S``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import redis
import redis.asyncio as aioredis

from kvmesh.services.aio import within

log = logging.getLogger(__name__)

#: Seconds between two warnings about Redis failures.
LOG_EVERY_S = 30.0
#: Seconds without shared-load calls after one failed; then background probes, one at a time.
COOLDOWN_S = 2.0


def checkpoints(block_hashes) -> list[tuple[int, bytes]]:
    """``[(position, hash)]`` at positions 1, 2, 4, 8, ... and ``len(block_hashes)``
    (1-based: position ``p`` is the hash of the first ``p`` blocks). Pure."""
    n = len(block_hashes)
    out = []
    p = 1
    while p < n:
        out.append((p, block_hashes[p - 1]))
        p *= 2
    if n:
        out.append((n, block_hashes[n - 1]))
    return out


def matched_prefix(block_hashes, cps: list[tuple[int, bytes]]) -> int:
    """Longest checkpoint position ``p`` with ``block_hashes[p - 1] == hash``: the request
    shares at least ``p`` leading blocks with the placement (0 if none). Pure."""
    best = 0
    n = len(block_hashes)
    for p, h in cps:
        if p <= n and p > best and block_hashes[p - 1] == h:
            best = p
    return best


def load_key(cluster: str) -> str:
    """Redis hash of every router's per-worker in-flight counts: ``kvmesh:{cluster}:router-load``."""
    return f"kvmesh:{cluster}:router-load"


class SharedLoad:
    """Publishes this router's per-worker counts and reads the other replicas'.

    Args:
        redis_url: Redis URL of the cluster.
        cluster: cluster name (key prefix).
        counts_fn: returns this router's ``{worker_id: (running, prefill_tokens, routed)}``.
        router_id: this router's id (default: random).
        stale_s: a replica's entry older than this is ignored and deleted (seconds); it
            republishes at least every ``stale_s / 3`` (on the next read after that).
        timeout_s: longest wait for one Redis call (seconds).
    """

    def __init__(self, redis_url: str, cluster: str, counts_fn, router_id: str | None = None,
                 stale_s: float = 15.0, timeout_s: float = 0.25):
        self.counts_fn = counts_fn
        self.key = load_key(cluster)
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.stale_s = stale_s
        self.timeout_s = timeout_s
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._last_warn = float("-inf")
        self._pending: asyncio.Task | None = None
        self._dirty = False
        self._last_write = 0.0
        self._write_lock = asyncio.Lock()
        self._down_until = float("-inf")  # after a failure, Redis is not asked until then
        self._failed = False   # a read failed and no probe has answered since: decisions do not read
        self._probe: asyncio.Task | None = None
        self._placements: list[tuple[str, float, list]] = []  # ours: (worker, expiry wall, checkpoints)
        #: the other replicas' live placements as of the last `others` call:
        #: ``[(worker_id, expiry (epoch seconds), [(position, hash)])]``
        self.remote_placements: list[tuple[str, float, list[tuple[int, bytes]]]] = []

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _probe_when_due(self) -> None:
        """After a failed read: once the cooldown is over, one background read at a time;
        the first that answers lets decisions read Redis again."""
        if not self._available() or (self._probe is not None and not self._probe.done()):
            return

        async def probe() -> None:
            try:
                await within(self._redis.hgetall(self.key), self.timeout_s)
            except (asyncio.TimeoutError, redis.RedisError, OSError) as exc:
                self._warn("read", exc)
            else:
                self._failed = False

        self._probe = asyncio.get_running_loop().create_task(probe())

    def _warn(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if what == "read":
            self._failed = True
        self._down_until = now + COOLDOWN_S  # no Redis call, and no added latency, for a while
        if now - self._last_warn >= LOG_EVERY_S:
            self._last_warn = now
            log.warning("shared router load: %s failed (%s); routing on this router's own counts", what, exc)

    async def others(self) -> dict[str, tuple[int, int, float]]:
        """``{worker_id: (running, prefill_tokens, routed)}`` summed over the other live
        replicas; ``{}`` when Redis does not answer within ``timeout_s``, and without asking
        it while no read has answered since one failed (see the module doc)."""
        self.remote_placements = []
        if self._failed:
            self._probe_when_due()
            return {}
        if not self._available():  # a write failed: the cooldown holds reads too
            return {}
        try:
            raw = await within(self._redis.hgetall(self.key), self.timeout_s)
        except (asyncio.TimeoutError, redis.RedisError, OSError) as exc:
            self._warn("read", exc)
            return {}
        if time.monotonic() - self._last_write > self.stale_s / 3:
            self.publish_soon()  # keep a long-running request's counts from going stale
        now = time.time()
        out: dict[str, list] = {}
        stale = []
        for field, value in raw.items():
            rid = field.decode() if isinstance(field, bytes) else field
            if rid == self.router_id:
                continue
            try:
                entry = json.loads(value)
                if now - float(entry["ts"]) > self.stale_s:
                    stale.append(field)
                    continue
                for wid, (running, prefill, routed) in entry["w"].items():
                    acc = out.setdefault(wid, [0, 0, 0.0])
                    acc[0] += int(running)
                    acc[1] += int(prefill)
                    acc[2] += float(routed)
                for wid, expiry, cps in entry.get("s", ()):
                    if float(expiry) > now:
                        self.remote_placements.append(
                            (str(wid), float(expiry), [(int(p), bytes.fromhex(h)) for p, h in cps]))
            except (ValueError, KeyError, TypeError):
                stale.append(field)  # not ours to read: drop it
        if stale:
            asyncio.get_running_loop().create_task(self._drop(stale))
        return {w: (a[0], a[1], a[2]) for w, a in out.items()}

    async def _drop(self, fields: list) -> None:
        try:
            await within(self._redis.hdel(self.key, *fields), self.timeout_s)
        except (asyncio.TimeoutError, redis.RedisError, OSError) as exc:
            self._warn("cleanup", exc)

    def note_placement(self, worker_id: str, block_hashes, ttl_s: float) -> None:
        """Record that this router just sent ``block_hashes`` to ``worker_id`` (shared with
        the next `publish`, for ``ttl_s`` seconds)."""
        now = time.time()
        self._placements = [pl for pl in self._placements if pl[1] > now]
        if block_hashes:
            self._placements.append((worker_id, now + ttl_s, checkpoints(block_hashes)))

    async def publish(self) -> None:
        """Write this router's counts (``counts_fn()``), awaited: call it right after a
        routing decision, before the next one is taken."""
        if not self._available():
            return
        async with self._write_lock:  # one write at a time, each with the counts as of its start
            counts = self.counts_fn()
            now = time.time()
            spec = [[w, round(exp, 3), [[p, h.hex()] for p, h in cps]] for w, exp, cps in self._placements
                    if exp > now]
            value = json.dumps({"ts": now, "w": {w: [r, p, round(s, 3)] for w, (r, p, s) in counts.items()},
                                "s": spec}, separators=(",", ":"))
            try:
                await within(self._redis.hset(self.key, self.router_id, value), self.timeout_s)
                self._last_write = time.monotonic()
            except (asyncio.TimeoutError, redis.RedisError, OSError) as exc:
                self._warn("write", exc)

    def publish_soon(self) -> None:
        """Schedule a `publish` (coalesced: at most one write in flight; a change during it
        is written right after). For completions, which need not wait."""
        self._dirty = True
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._dirty:
            self._dirty = False
            await self.publish()

    async def close(self) -> None:
        """Remove this router's entry (best effort) and close the client."""
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
        try:
            await within(self._redis.hdel(self.key, self.router_id), self.timeout_s)
        except (asyncio.TimeoutError, redis.RedisError, OSError):
            pass
        try:
            await within(self._redis.aclose(), 2.0)
        except (asyncio.TimeoutError, redis.RedisError, OSError):
            pass
