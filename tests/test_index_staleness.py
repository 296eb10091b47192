"""The router's index stays true when event batches are lost and when Redis restarts empty.

Real redis-server; publishers, leases and the subscriber run in-process. A worker's
"true set" is the cache state its events describe, which is also what its snapshot
(the resync callback) returns.
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
from kvmesh.services.index_subscriber import IndexSubscriber
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
