"""The router's index stays true when event batches are lost and when Redis loses its data
(restarts empty, or FLUSHALL while it runs), and membership is held across such a loss only.

Real redis-server; publishers, leases and the subscriber run in-process, but for one test
that runs a real router and real workers under load. A worker's "true set" is the cache
state its events describe, which is also what its snapshot (the resync callback) returns.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis

from kvmesh.cache_store.events import AllBlocksCleared, BlockStored
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.index_subscriber import IndexSubscriber, data_marker_key
from kvmesh.services.procs import RedisServer
from kvmesh.workers.kv_publisher import KVEventPublisher, WorkerLease, lease_key, stream_key

POLL = 0.1
# Registry polls allowed once the leases report the lost batch: the poll under way may have
# read the lease just before (1), the next one sees it and starts the resync (2), which may
# wait one poll interval after an earlier resync (3) and lands by the poll after (4).
CONVERGE_POLLS = 4


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Worker:
    """Publisher + lease (with kv_seq) + the cache state its events describe."""

    def __init__(self, url: str, cluster: str, worker_id: str, interval_s: float = 0.2):
        self.url, self.cluster, self.worker_id, self.interval_s = url, cluster, worker_id, interval_s
        self.blocks: set[bytes] = set()
        self.pub = KVEventPublisher(url, worker_id, cluster=cluster, flush_interval_s=0.01)
        self.lease = self._lease()

    def _lease(self) -> WorkerLease:
        return WorkerLease(self.url, self.worker_id, f"{self.worker_id}:7000", {"block_size": 1, "model_id": "m"},
                           lambda: {}, cluster=self.cluster, ttl_s=3.0, interval_s=self.interval_s,
                           fields_fn=self.pub.lease_fields)

    def publish(self, event, lose: bool = False) -> None:
        """Emit one event as its own batch and wait until it is appended (or, with
        ``lose``, settled without reaching the stream: a batch lost after its append)."""
        if isinstance(event, BlockStored):
            self.blocks.update(event.block_hashes)
        else:
            self.blocks.clear()
        real = self.pub._redis.xadd
        if lose:
            self.pub._redis.xadd = lambda *a, **k: b"0-1"  # fault injection: the entry vanishes
        try:
            self.pub.sink(event)
            assert self.pub.wait_published(5.0)
        finally:
            self.pub._redis.xadd = real

    async def snapshot(self):
        return self.pub.flush_now(), [(h, None, "device") for h in self.blocks]

    def truth(self) -> dict:
        return {h: frozenset({"device"}) for h in self.blocks}

    def restart_lease(self) -> None:
        self.lease = self._lease()

    def close(self) -> None:
        self.pub.close()
        self.lease.close()


def stored(i: int) -> BlockStored:
    return BlockStored([H(i)], None, [i], 1, "device")


async def leases_settled(workers: list[Worker], timeout: float = 60.0) -> None:
    """Wait until each worker's lease in Redis reports every batch it numbered as settled
    (``kv_seq``): from then on the subscriber's next registry poll can see it all."""
    rc = redis.Redis.from_url(workers[0].url)
    try:
        deadline = time.monotonic() + timeout  # only against a hang: the wait is for an event
        while True:
            raw = [rc.get(lease_key(w.worker_id, w.cluster)) for w in workers]
            if all(r is not None and json.loads(r).get("kv_seq") == w.pub.stats()["last_seq"]
                   for r, w in zip(raw, workers)):
                return
            assert time.monotonic() < deadline, "the leases never reported the workers' last batches"
            await asyncio.sleep(0.02)
    finally:
        rc.close()


async def converged(index: ClusterIndex, sub: IndexSubscriber, workers: list[Worker],
                    polls: int = CONVERGE_POLLS) -> int:
    """Once the leases report every batch, the index must equal each worker's true set within
    ``polls`` registry polls of the subscriber (its own clock, which a busy machine slows
    down with everything else). Returns the polls it took."""
    await leases_settled(workers)
    start = sub._polls
    backstop = time.monotonic() + 60.0  # only if the subscriber stopped polling altogether
    while True:
        if all(index.worker_blocks(w.worker_id) == w.truth() for w in workers):
            return sub._polls - start
        assert time.monotonic() < backstop, f"the subscriber made {sub._polls - start} polls in 60 s"
        if sub._polls >= start + polls:
            got = {w.worker_id: len(index.worker_blocks(w.worker_id)) for w in workers}
            want = {w.worker_id: len(w.blocks) for w in workers}
            raise AssertionError(f"index not converged within {polls} polls: has {got}, workers hold {want}")
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def shared_redis():
    server = RedisServer()
    yield server
    server.stop()


def make_subscriber(url: str, cluster: str, workers: dict[str, Worker], **kw):
    index = ClusterIndex()

    async def resync(worker_id, address):
        return await workers[worker_id].snapshot()

    return index, IndexSubscriber(url, index, resync, cluster=cluster, poll_interval_s=POLL, **kw)


@pytest.mark.parametrize("position", ["first", "middle", "last", "whole"])
def test_router_starting_after_a_lost_batch_converges(shared_redis, position):
    """Batches 1..5 are published, then one (or the whole stream) is deleted before any
    router reads it; a router starting then holds each worker's true set within a few polls."""
    cluster = "t" + uuid.uuid4().hex[:8]
    w = Worker(shared_redis.url, cluster, "w1")
    other = Worker(shared_redis.url, cluster, "w2")
    rc = redis.Redis.from_url(shared_redis.url)

    async def main():
        for i in range(4):
            w.publish(stored(i))
        w.publish(AllBlocksCleared() if position == "last" else stored(10))
        other.publish(stored(100))
        entries = rc.xrange(stream_key("w1", cluster))
        assert len(entries) == 5
        if position == "whole":
            rc.xtrim(stream_key("w1", cluster), maxlen=0, approximate=False)
        else:
            victim = {"first": 0, "middle": 2, "last": 4}[position]
            rc.xdel(stream_key("w1", cluster), entries[victim][0])
        await leases_settled([w, other])  # leases carry kv_seq = 5
        index, sub = make_subscriber(shared_redis.url, cluster, {"w1": w, "w2": other})
        await sub.start()
        try:
            await converged(index, sub, [w, other])
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        w.close()
        other.close()
        rc.close()


@pytest.mark.parametrize("position", ["middle", "last"])
def test_running_router_detects_a_lost_batch(shared_redis, position):
    """A router already in step: a batch of an idle worker is lost after its append (here
    the last one records a cache clear, as in the field report). Within a few registry polls
    of the lease reporting it, the index equals the worker's true set again."""
    cluster = "t" + uuid.uuid4().hex[:8]
    w = Worker(shared_redis.url, cluster, "w1")

    async def main():
        index, sub = make_subscriber(shared_redis.url, cluster, {"w1": w})
        await sub.start()
        try:
            for i in range(20):
                w.publish(stored(i))
            await converged(index, sub, [w])
            if position == "last":
                w.publish(AllBlocksCleared(), lose=True)  # the worker now holds nothing, idle
            else:
                w.publish(stored(50), lose=True)
                w.publish(stored(51))
            took = await converged(index, sub, [w])
            assert took <= CONVERGE_POLLS
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        w.close()


def test_redis_restart_keeps_membership_and_resyncs():
    """Redis restarts empty and the workers re-register only after the router has reached it
    again: the router keeps both workers live throughout, and resyncs each from its snapshot once its
    lease is back (events published just before the restart were lost with the data)."""
    server = RedisServer()
    port = server.port
    cluster = "t" + uuid.uuid4().hex[:8]
    workers = {f"w{i}": Worker(server.url, cluster, f"w{i}") for i in range(2)}

    async def main():
        nonlocal server
        index, sub = make_subscriber(server.url, cluster, workers, redis_restart_grace_s=10.0)
        await sub.start()
        try:
            for i, w in enumerate(workers.values()):
                for j in range(5):
                    w.publish(stored(100 * i + j))
            await converged(index, sub, list(workers.values()))
            old_run_id = sub._run_id
            for w in workers.values():
                w.lease.close(delete=False)  # the heartbeats pause across the restart
            server.stop()
            for w in workers.values():  # the cache changes while Redis is away
                w.blocks.add(H(999))
                w.pub.sink(stored(999))
            missing = []

            async def watch(seconds: float, until=None):
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    live = sub.live_workers()
                    if set(live) != set(workers):
                        missing.append(sorted(live))
                    if until is not None and until():
                        return
                    await asyncio.sleep(0.05)
                assert until is None, "the router never reached the restarted Redis"

            await watch(1.0)
            server = RedisServer(port=port, password=server.password)  # empty, same credentials
            # the router reconnects (it polled the new server) before the workers re-register
            await watch(60.0, until=lambda: sub._run_id not in (None, old_run_id))
            for w in workers.values():
                w.restart_lease()
            await watch(0.5)
            assert not missing, f"router lost workers during the restart: {missing[:3]}"
            await converged(index, sub, list(workers.values()))
            assert sub.resyncs >= 2
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        for w in workers.values():
            w.close()
        server.stop()


async def until(sub: IndexSubscriber, cond, polls: int, what: str) -> int:
    """Wait until ``cond()`` holds, at most ``polls`` registry polls of the subscriber (its
    own clock, which a busy machine slows down with everything else). Returns the polls it took."""
    start = sub._polls
    backstop = time.monotonic() + 60.0  # only if the subscriber stopped polling altogether
    while not cond():
        assert sub._polls <= start + polls, f"{what}: not within {polls} polls"
        assert time.monotonic() < backstop, f"{what}: the subscriber made {sub._polls - start} polls in 60 s"
        await asyncio.sleep(0.01)
    return sub._polls - start


async def watch_live(sub: IndexSubscriber, want: set[str], polls: int) -> list:
    """The live sets other than ``want`` seen over the next ``polls`` registry polls."""
    missing = []
    end = sub._polls + polls
    while sub._polls < end:
        live = set(sub.live_workers())
        if live != want:
            missing.append(sorted(live))
        await asyncio.sleep(0.01)
    return missing


def with_two_converged_workers(body) -> None:
    """Start a private redis-server, two `Worker`s with five published blocks each and a
    subscriber (grace 10 s) that has converged on them; then ``await body(index, sub,
    workers, rc)`` (``rc``: a Redis client); stop everything afterwards."""
    server = RedisServer()
    cluster = "t" + uuid.uuid4().hex[:8]
    workers = {f"w{i}": Worker(server.url, cluster, f"w{i}") for i in range(2)}
    rc = redis.Redis.from_url(server.url)

    async def main():
        index, sub = make_subscriber(server.url, cluster, workers, redis_restart_grace_s=10.0)
        await sub.start()
        try:
            for i, w in enumerate(workers.values()):
                for j in range(5):
                    w.publish(stored(100 * i + j))
            await converged(index, sub, list(workers.values()))
            await body(index, sub, workers, rc)
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        for w in workers.values():
            w.close()
        rc.close()
        server.stop()


def test_flushall_keeps_membership_and_resyncs():
    """FLUSHALL wipes every lease, stream and the workers set while Redis keeps running (same
    run_id) and the workers stay up: the router keeps both workers live, with their index
    entries, until their leases are back, then resyncs each from its snapshot."""

    async def body(index, sub, workers, rc):
        resyncs = sub.resyncs
        for w in workers.values():
            w.lease.close(delete=False)  # no beat lands between the flush and the polls watched
        assert rc.flushall()
        missing = await watch_live(sub, set(workers), polls=5)
        assert not missing, f"router lost workers after FLUSHALL: {missing[:3]}"
        for w in workers.values():  # a prompt cached before the flush is still found
            assert index.worker_blocks(w.worker_id) == w.truth()
        for w in workers.values():  # the cache changes meanwhile; the events go to new streams
            w.publish(stored(999))
            w.restart_lease()
        missing = await watch_live(sub, set(workers), polls=5)
        assert not missing, f"router lost workers as they re-registered: {missing[:3]}"
        await converged(index, sub, list(workers.values()))
        assert sub.resyncs >= resyncs + 2

    with_two_converged_workers(body)


def test_a_redis_stall_longer_than_the_leases_keeps_membership():
    """``CLIENT PAUSE`` (a failover, a slow fork) for longer than the leases' 3 s TTL: Redis's
    clock expires every lease meanwhile, though no worker left. The router's first poll
    after the pause found no lease and dropped every worker and its index entries (clients
    got "no live workers" until the next beats); it now keeps them while they beat again,
    with their entries, and resyncs nothing (their streams are intact)."""

    async def body(index, sub, workers, rc):
        resyncs = sub.resyncs
        for w in workers.values():
            w.lease.close(delete=False)  # no beat queued behind the pause renews a lease
        polls = sub._polls
        rc.execute_command("CLIENT", "PAUSE", 4000, "ALL")
        await until(sub, lambda: sub._polls > polls + 1, 2, "a poll after the pause")
        missing = await watch_live(sub, set(workers), polls=5)
        assert not missing, f"router lost workers after a stall: {missing[:3]}"
        assert sub.stalls == 1
        for w in workers.values():
            assert index.worker_blocks(w.worker_id) == w.truth()
            w.restart_lease()
        await until(sub, lambda: not sub._awaited, 50, "the workers beat again")
        assert not await watch_live(sub, set(workers), polls=5)
        await converged(index, sub, list(workers.values()))
        assert sub.resyncs == resyncs

    with_two_converged_workers(body)


def test_workers_leaving_are_dropped_at_once_and_a_flush_holds_them_only_for_the_grace():
    """Only a loss of Redis's data holds workers: a worker whose lease is deleted (drain) is
    dropped at the next poll, also when it is the last one; after a FLUSHALL a worker that
    re-registered and then leaves is dropped at once, and one that never comes back (a real
    mass death) only when the grace is over."""
    server = RedisServer()
    cluster = "t" + uuid.uuid4().hex[:8]
    workers = {f"w{i}": Worker(server.url, cluster, f"w{i}") for i in range(3)}
    rc = redis.Redis.from_url(server.url)
    grace = 4.0
    # the poll under way may have read the lease just before (1); the next one sees it gone (2)
    at_once = 2

    async def main():
        index, sub = make_subscriber(server.url, cluster, workers, redis_restart_grace_s=grace)
        await sub.start()
        loop = asyncio.get_running_loop()
        try:
            for i, w in enumerate(workers.values()):
                w.publish(stored(i))
            await converged(index, sub, list(workers.values()))
            w0, w1, w2 = workers.values()

            w0.lease.close()  # drained: its lease is deleted
            await until(sub, lambda: "w0" not in sub.live_workers() and not index.worker_blocks("w0"), at_once,
                        "a drained worker dropped")

            for w in (w1, w2):
                w.lease.close(delete=False)
            assert rc.flushall()
            flushed = loop.time()
            assert await watch_live(sub, {"w1", "w2"}, polls=3) == []
            w1.restart_lease()  # back, and then drained within the grace
            await until(sub, lambda: rc.get(lease_key("w1", cluster)) is not None, 50, "w1's lease back")
            await sub.wait_synced()
            w1.lease.close()
            await until(sub, lambda: "w1" not in sub.live_workers(), at_once, "a re-registered worker that drained")
            assert "w2" in sub.live_workers() and loop.time() < flushed + grace
            # w2 never comes back: held for the grace, not longer
            await until(sub, lambda: not sub.live_workers(), int(grace / POLL) + 10, "the grace ended")
            assert loop.time() >= flushed + grace
            assert not index.workers()

            # a worker alone that drains is dropped at once: every known lease vanished, the
            # workers set and the data marker did not
            w3 = workers["w3"] = Worker(server.url, cluster, "w3")
            w3.publish(stored(3))
            await until(sub, lambda: "w3" in sub.live_workers(), 50, "w3 registered")
            w3.lease.close()
            await until(sub, lambda: not sub.live_workers(), at_once, "the only worker drained")
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        for w in workers.values():
            w.close()
        rc.close()
        server.stop()


def test_flushall_of_a_full_redis_keeps_membership():
    """A Redis over its maxmemory under noeviction (filled by remote-tier blocks) refuses plain
    writes, which is when an operator may flush it: the data marker is written all the same,
    so the FLUSHALL that follows holds the worker as on any other Redis."""
    server = RedisServer()
    cluster = "t" + uuid.uuid4().hex[:8]
    rc = redis.Redis.from_url(server.url)
    pipe = rc.pipeline(transaction=False)
    for i in range(4000):
        pipe.set(f"filler:{i}", b"x" * 1000)
    pipe.execute()
    time.sleep(0.5)
    rc.config_set("maxmemory-policy", "noeviction")
    rc.config_set("maxmemory", int(rc.info("memory")["used_memory"]) - 2_000_000)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        rc.set("plain", "refused")
    w = Worker(server.url, cluster, "w0")  # its lease beats on a full Redis (allow-oom)

    async def main():
        index, sub = make_subscriber(server.url, cluster, {"w0": w}, redis_restart_grace_s=10.0)
        await sub.start()
        try:
            await until(sub, lambda: "w0" in sub.live_workers(), 50, "w0 registered")
            await until(sub, lambda: rc.get(data_marker_key(cluster)) is not None, 3, "data marker written")
            w.lease.close(delete=False)
            assert rc.flushall()
            assert await watch_live(sub, {"w0"}, polls=5) == []
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        w.close()
        rc.close()
        server.stop()


def _router_resyncs(metrics_url: str, name: str = "router_gap_resyncs_total") -> float:
    """A counter of the router's metrics: by default ``router_gap_resyncs_total`` (snapshots
    its index applied)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"kvmesh:{name} "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in the router's metrics")


@pytest.mark.slow
def test_flushall_under_load_fails_no_request(tmp_path):
    """A real router and two real workers under load, clients without retries: FLUSHALL on the
    cluster's Redis (several times, at random moments against the lease beats) fails no request,
    and after the last one the router's index is resynced and routes each prompt sent before
    it to the worker that cached it."""
    import random
    import threading

    import grpc

    from kvmesh.services.client import KvmeshClient
    from kvmesh.services.launcher import ClusterSpec, LocalCluster

    rng = random.Random(5)

    def prompt(n: int = 64) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    spec = ClusterSpec(num_workers=2, num_blocks=1024, threads_per_worker=1, log_dir=str(tmp_path))
    with LocalCluster(spec) as cluster, KvmeshClient(cluster.router_address, retries=0, timeout=60) as client:
        rc = redis.Redis.from_url(cluster.redis_url)
        try:
            probes = [prompt() for _ in range(6)]
            holder = {}
            for i, p in enumerate(probes):
                out = client.generate(token_ids=p, max_tokens=1)
                assert out.usage.cached_tokens == 0
                holder[i] = out.worker_id
            assert len(set(holder.values())) == 2, "the probes all went to one worker: nothing to route"

            pool = [prompt() for _ in range(16)]
            stop = threading.Event()
            ok, failed = [0], []

            def load(seed: int) -> None:
                mine = random.Random(seed)
                while not stop.is_set():
                    try:
                        client.generate(token_ids=mine.choice(pool), max_tokens=2)
                        ok[0] += 1
                    except grpc.RpcError as exc:
                        failed.append((exc.code(), exc.details()))

            threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(3)]
            for t in threads:
                t.start()
            try:
                time.sleep(1.0)
                for _ in range(5):  # the lease beats every second: some flushes land far from the next one
                    assert rc.flushall()
                    time.sleep(rng.uniform(0.8, 1.6))
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            assert not failed, f"{len(failed)} of {len(failed) + ok[0]} requests failed, e.g. {failed[:3]}"
            assert ok[0] > 20

            time.sleep(1.5)  # the last flush's resyncs are done
            before = _router_resyncs(cluster.metrics_urls["router"])
            losses = _router_resyncs(cluster.metrics_urls["router"], "router_redis_data_losses_total")
            assert losses >= 1  # the flushes under load were seen as such
            assert rc.flushall()
            deadline = time.monotonic() + 60
            while _router_resyncs(cluster.metrics_urls["router"]) < before + 2:  # each worker, lease back
                assert time.monotonic() < deadline, "the router did not resync both workers after FLUSHALL"
                time.sleep(0.1)
            assert _router_resyncs(cluster.metrics_urls["router"], "router_redis_data_losses_total") == losses + 1
            for i, p in enumerate(probes):
                out = client.generate(token_ids=p, max_tokens=1)
                assert (out.worker_id, out.usage.cached_tokens > 0) == (holder[i], True), i
        finally:
            rc.close()
