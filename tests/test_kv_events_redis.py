"""KV event plane against a real redis-server: publisher -> stream -> subscriber -> index."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import pytest
import redis

from kvmesh.cache_store.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.index_subscriber import IndexSubscriber
from kvmesh.services.procs import RedisServer, free_port
from kvmesh.workers.kv_publisher import (KVEventPublisher, WorkerLease, lease_key, prune_worker_ids, stream_key,
                                         workers_key)

POLL = 0.1


@pytest.fixture(scope="module")
def shared_redis():
    """One private redis-server for this module; tests separate by cluster name."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def cluster():
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture
def rclient(shared_redis):
    client = redis.Redis.from_url(shared_redis.url)
    yield client
    client.close()


def H(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(ids, medium="device") -> BlockStored:
    return BlockStored([H(i) for i in ids], None, list(range(len(ids))), 1, medium)


class Worker:
    """A publisher, a lease and the cache state the events describe (the snapshot)."""

    def __init__(self, url, cluster, worker_id, ttl_s=3.0, interval_s=0.2, **pub_kw):
        self.worker_id = worker_id
        self.blocks: dict[bytes, set[str]] = {}
        self.pub = KVEventPublisher(url, worker_id, cluster=cluster, flush_interval_s=0.01, **pub_kw)
        self.lease = WorkerLease(url, worker_id, f"{worker_id}:7000", {"block_size": 1, "model_id": "m"},
                                 lambda: {"running_requests": 2, "queued_prefill_tokens": 5},
                                 cluster=cluster, ttl_s=ttl_s, interval_s=interval_s)

    def emit(self, ev):
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                self.blocks.setdefault(h, set()).add(ev.medium)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                media = self.blocks.get(h, set())
                media.discard(ev.medium)
                if not media:
                    self.blocks.pop(h, None)
        else:
            self.blocks.clear()
        self.pub.sink(ev)

    async def snapshot(self):
        seq = self.pub.flush_now()
        return seq, [(h, None, m) for h, media in self.blocks.items() for m in media]

    def expected(self):
        return {h: frozenset(m) for h, m in self.blocks.items()}

    def close(self, delete=True):
        self.pub.close()
        self.lease.close(delete=delete)


def no_resync():
    calls = []

    async def resync(worker_id, address):
        calls.append(worker_id)
        raise AssertionError(f"unexpected resync of {worker_id}")

    return resync, calls


async def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


async def synced(sub, *worker_ids):
    """``sub.wait_synced`` once each of ``worker_ids`` is live to it. A `Worker`'s first lease
    beat runs on its own thread: a subscriber polling before it lands has no live worker to
    sync with, and its wait returned before reading anything (a loaded machine saw it)."""
    await wait_until(lambda: set(worker_ids) <= set(sub.live_workers()), timeout=60.0)
    await sub.wait_synced(5.0)


class HungRedis:
    """Stands in for a publisher's Redis client: every call blocks until ``release`` is set
    (or, as a last resort against a deadlocked test, 30 s pass, recorded in ``expired``),
    then fails like a dropped connection."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.expired: list[str] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.entered.set()
            if not self.release.wait(30):
                self.expired.append(name)
            raise redis.ConnectionError("hung redis released")
        return call


# ------------------------------------------------------------------ publisher
def test_publisher_numbers_batches_in_order_and_splits_large_ones(shared_redis, cluster, rclient):
    pub = KVEventPublisher(shared_redis.url, "w1", cluster=cluster, flush_interval_s=0.5, max_batch_events=3)
    try:
        assert pub.flush_now() == 0
        for i in range(7):
            pub.sink(stored([i]))
        assert pub.flush_now() == 3  # 7 events -> batches of 3, 3, 1, numbered at once
        pub.sink(BlockRemoved([H(0)]))
        pub.sink(AllBlocksCleared())
        assert pub.wait_published(5.0)
        assert pub.stats()["last_seq"] == 4
        entries = rclient.xrange(stream_key("w1", cluster))
        seqs = [int(f[b"seq"]) for _, f in entries]
        assert seqs == [1, 2, 3, 4]
        batches = [decode_batch(f[b"data"]) for _, f in entries]
        assert [b.seq for b in batches] == seqs and all(b.worker_id == "w1" for b in batches)
        assert [len(b.events) for b in batches] == [3, 3, 1, 2]
        assert [e.block_hashes[0] for b in batches[:3] for e in b.events] == [H(i) for i in range(7)]
        assert len({f[b"epoch"] for _, f in entries}) == 1
    finally:
        pub.close()


def test_publisher_survives_redis_outage_and_drops_oldest_keeping_numbering(cluster):
    port = free_port()
    url = f"redis://:outage-test-pw@127.0.0.1:{port}/0"
    pub = KVEventPublisher(url, "w1", cluster=cluster, flush_interval_s=0.01, max_queued_batches=2)
    real_client = pub._redis
    hung = HungRedis()
    server = None
    try:
        # The publisher thread is stuck inside a Redis call (as with a Redis that accepts and
        # never answers) until this test lets it go, which it does only after the engine-side
        # calls returned: had any of them waited for that call, it would have returned only
        # once the hang timed out by itself, which the hang records.
        pub._redis = hung
        assert hung.entered.wait(30), "the publisher thread never called Redis"
        for i in range(5):
            pub.sink(stored([i]))
            assert pub.flush_now() == i + 1
        assert hung.expired == [], "the engine side waited for Redis"  # it never waits for Redis
        pub._redis = real_client  # from here on an unreachable Redis: each call fails at once
        hung.release.set()
        assert not pub.wait_published(0.2)
        assert pub.stats()["dropped"] == 3
        server = RedisServer(port=port, password="outage-test-pw")
        assert pub.wait_published(10.0)
        client = redis.Redis.from_url(url)
        seqs = [int(f[b"seq"]) for _, f in client.xrange(stream_key("w1", cluster))]
        client.close()
        assert seqs == [4, 5]  # the survivors keep their numbers: readers see the gap
        stats = pub.stats()
        assert stats["published"] == 2 and stats["errors"] >= 1
    finally:
        pub._redis = real_client
        hung.release.set()
        pub.close(timeout=1.0)
        if server is not None:
            server.stop()


def test_lease_is_written_with_ttl_and_deleted_on_close(shared_redis, cluster, rclient):
    lease = WorkerLease(shared_redis.url, "w9", "10.0.0.9:5000", {"block_size": 16, "model_id": "tiny"},
                        lambda: {"running_requests": 3}, cluster=cluster, ttl_s=2.0, interval_s=0.1)
    try:
        deadline = time.monotonic() + 5
        while rclient.get(lease_key("w9", cluster)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        value = json.loads(rclient.get(lease_key("w9", cluster)))
        assert value["worker_id"] == "w9" and value["address"] == "10.0.0.9:5000"
        assert value["block_size"] == 16 and value["model_id"] == "tiny"
        assert value["load"] == {"running_requests": 3} and abs(value["ts"] - time.time()) < 5
        assert 0 < rclient.pttl(lease_key("w9", cluster)) <= 2000
        assert rclient.smembers(workers_key(cluster)) == {b"w9"}
    finally:
        lease.close()
    assert rclient.get(lease_key("w9", cluster)) is None
    assert rclient.smembers(workers_key(cluster)) == {b"w9"}  # "ever registered" stays


def test_beat_gives_the_event_stream_an_idle_ttl(shared_redis, cluster, rclient):
    """A gone worker's stream must not stay in Redis forever: each beat pushes its expiry on."""
    rclient.xadd(stream_key("w8", cluster), {"seq": "1", "epoch": "e", "data": b""})
    assert rclient.pttl(stream_key("w8", cluster)) == -1  # no TTL before a beat
    lease = WorkerLease(shared_redis.url, "w8", "10.0.0.8:5000", {}, lambda: {}, cluster=cluster,
                        ttl_s=2.0, interval_s=0.1, stream_idle_ttl_s=30.0)
    try:
        deadline = time.monotonic() + 10
        while rclient.pttl(stream_key("w8", cluster)) < 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert 0 < rclient.pttl(stream_key("w8", cluster)) <= 30_000
        assert rclient.xlen(stream_key("w8", cluster)) == 1  # the entries are kept
    finally:
        lease.close()
    with pytest.raises(ValueError, match="stream_idle_ttl_s"):
        WorkerLease(shared_redis.url, "w7", "a:1", {}, lambda: {}, cluster=cluster, ttl_s=2.0,
                    interval_s=0.1, stream_idle_ttl_s=2.0)


def test_leases_beat_while_redis_is_full(cluster):
    """A Redis over its maxmemory under noeviction (filled by KV records) refuses SET; the lease
    beat is flagged allow-oom, so workers stay in the routers' view."""
    server = RedisServer()
    raw = redis.Redis.from_url(server.url)
    lease = None
    try:
        pipe = raw.pipeline(transaction=False)
        for i in range(4000):  # small values: no large query buffer that Redis frees later
            pipe.set(f"filler:{i}", b"x" * 1000)
        pipe.execute()
        time.sleep(0.5)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 2_000_000)  # well over it
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            raw.set("plain", "refused")  # what an unflagged lease write would get
        lease = WorkerLease(server.url, "w6", "10.0.0.6:5000", {}, lambda: {}, cluster=cluster,
                            ttl_s=2.0, interval_s=0.1)
        deadline = time.monotonic() + 30
        while raw.get(lease_key("w6", cluster)) is None:
            assert time.monotonic() < deadline, "no lease written on a full Redis"
            time.sleep(0.05)
        first = json.loads(raw.get(lease_key("w6", cluster)))["ts"]
        while json.loads(raw.get(lease_key("w6", cluster)) or b'{"ts": 0}')["ts"] == first:
            assert time.monotonic() < deadline, "the lease was not renewed on a full Redis"
            time.sleep(0.05)
        assert raw.smembers(workers_key(cluster)) == {b"w6"}
    finally:
        if lease is not None:
            lease.close()
        raw.close()
        server.stop()


def test_prune_removes_only_ids_whose_lease_and_stream_are_gone(rclient, cluster):
    rclient.sadd(workers_key(cluster), "gone", "leased", "streamed")
    rclient.set(lease_key("leased", cluster), "{}", px=60_000)
    rclient.xadd(stream_key("streamed", cluster), {"seq": "1"})
    assert prune_worker_ids(rclient, ["gone", "leased", "streamed", "never-in-set"], cluster) == 1
    assert rclient.smembers(workers_key(cluster)) == {b"leased", b"streamed"}
    assert prune_worker_ids(rclient, [], cluster) == 0


def test_subscriber_prunes_gone_workers_from_the_registry(shared_redis, cluster, rclient):
    rclient.sadd(workers_key(cluster), *[f"old-{i}" for i in range(40)], "streamed")
    rclient.xadd(stream_key("streamed", cluster), {"seq": "1"})  # no lease, stream not expired: kept

    async def main():
        a = Worker(shared_redis.url, cluster, "a")
        index = ClusterIndex()
        resync, _ = no_resync()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        await sub.start()
        try:
            await wait_until(lambda: set(sub.live_workers()) == {"a"}, timeout=30.0)
            await wait_until(lambda: rclient.smembers(workers_key(cluster)) == {b"a", b"streamed"}, timeout=30.0)
            # the count is what Redis replied: a reply lost to a timeout on a loaded machine
            # (redis-py then runs the script again, which finds nothing left) counts 0
            assert sub.pruned_ids in (0, 40)
        finally:
            await sub.stop()
            a.close()

    asyncio.run(main())


# ----------------------------------------------------------------- round trip
def test_round_trip_publisher_to_index(shared_redis, cluster):
    async def main():
        a = Worker(shared_redis.url, cluster, "a")
        b = Worker(shared_redis.url, cluster, "b")
        index = ClusterIndex()
        resync, calls = no_resync()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        await sub.start()  # awaiting is optional
        with pytest.raises(RuntimeError):
            sub.start()
        try:
            a.emit(stored([1, 2, 3]))
            a.emit(stored([1, 2], medium="host"))
            a.emit(BlockRemoved([H(1)], "device"))
            b.emit(stored([1, 2, 10]))
            a.pub.wait_published()
            b.emit(AllBlocksCleared())
            b.emit(stored([20, 21]))
            for w in (a, b):
                assert w.pub.wait_published()
            # a lease is first written by its own thread's first beat: on a busy machine that can
            # come after a registry poll, so wait for both to be live, then for their streams
            await wait_until(lambda: set(sub.live_workers()) == {"a", "b"}, timeout=30.0)
            await sub.wait_synced(5.0)
            assert set(sub.live_workers()) == {"a", "b"}
            lease = sub.live_workers()["a"]
            assert lease["address"] == "a:7000" and lease["load"]["queued_prefill_tokens"] == 5
            for w in (a, b):
                assert index.worker_blocks(w.worker_id) == w.expected()
                assert index.last_seq(w.worker_id) == w.pub.stats()["last_seq"]
            m = index.match([H(1), H(2), H(3), H(4)], now=0.0)
            assert m["a"].num_blocks == 3 and m["a"].by_medium == {"host": 1, "device": 2}
            assert m["b"].num_blocks == 0
            # Later traffic keeps flowing in.
            b.emit(stored([1]))
            assert b.pub.wait_published()
            await sub.wait_synced(5.0)
            assert index.match([H(1)], now=0.0)["b"].num_blocks == 1
            assert calls == [] and sub.resyncs == 0
        finally:
            await sub.stop()
            a.close()
            b.close()

    asyncio.run(main())


def test_second_subscriber_started_later_rebuilds_the_same_index_from_redis(shared_redis, cluster):
    async def main():
        workers = [Worker(shared_redis.url, cluster, f"w{i}") for i in range(3)]
        first = ClusterIndex()
        resync, calls = no_resync()
        sub1 = IndexSubscriber(shared_redis.url, first, resync, cluster=cluster, poll_interval_s=POLL)
        sub1.start()
        try:
            for step in range(30):
                w = workers[step % 3]
                w.emit(stored([step, step + 100]))
                if step % 7 == 6:
                    w.emit(BlockRemoved([H(step)]))
                if step == 20:
                    w.emit(AllBlocksCleared())
                w.pub.flush_now()
            for w in workers:
                assert w.pub.wait_published()
            await synced(sub1, "w0", "w1", "w2")
            # No new traffic from here on: the late subscriber has only what Redis kept.
            second = ClusterIndex()
            sub2 = IndexSubscriber(shared_redis.url, second, resync, cluster=cluster, poll_interval_s=POLL)
            sub2.start()
            try:
                await synced(sub2, "w0", "w1", "w2")
                assert second.workers() == first.workers() == ["w0", "w1", "w2"]
                for w in workers:
                    assert second.worker_blocks(w.worker_id) == first.worker_blocks(w.worker_id) == w.expected()
                    assert second.last_seq(w.worker_id) == first.last_seq(w.worker_id) > 1
            finally:
                await sub2.stop()
            assert calls == []
        finally:
            await sub1.stop()
            for w in workers:
                w.close()

    asyncio.run(main())


# --------------------------------------------------------------------- resync
def test_stream_trimmed_before_the_subscriber_starts_triggers_resync(shared_redis, cluster, rclient):
    async def main():
        w = Worker(shared_redis.url, cluster, "a")
        calls = []

        async def resync(worker_id, address):
            calls.append((worker_id, address))
            return await w.snapshot()

        try:
            for i in range(5):
                w.emit(stored([i]))
                w.pub.flush_now()
            assert w.pub.wait_published()
            rclient.xtrim(stream_key("a", cluster), maxlen=2, approximate=False)  # seqs 4, 5 left
            index = ClusterIndex()
            sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
            sub.start()
            try:
                await synced(sub, "a")
                assert calls == [("a", "a:7000")]
                assert index.worker_blocks("a") == w.expected()
                assert index.last_seq("a") == 5
                # After the snapshot it continues from the stream.
                w.emit(BlockRemoved([H(0)]))
                assert w.pub.wait_published()
                await sub.wait_synced(5.0)
                assert index.worker_blocks("a") == w.expected() and index.last_seq("a") == 6
                assert len(calls) == 1
            finally:
                await sub.stop()
        finally:
            w.close()

    asyncio.run(main())


def test_failed_resync_drops_the_worker_and_is_retried(shared_redis, cluster, rclient):
    async def main():
        # A worker known only through Redis: a lease and hand-written stream entries.
        lease = WorkerLease(shared_redis.url, "a", "a:7000", {}, dict, cluster=cluster, ttl_s=3.0, interval_s=0.1)
        lease.beat()  # registered now, not whenever its thread first runs
        key = stream_key("a", cluster)

        def publish(seq, *events):
            data = encode_batch(EventBatch("a", seq, time.time(), list(events)))
            rclient.xadd(key, {"seq": str(seq), "epoch": "e1", "data": data})

        calls = []
        retry_may_finish = asyncio.Event()

        async def resync(worker_id, address):
            calls.append(worker_id)
            if len(calls) == 1:
                raise ConnectionError("worker unreachable")
            await retry_may_finish.wait()
            return 4, [(H(7), None, "host")]

        index = ClusterIndex()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        sub.start()
        try:
            publish(1, stored([1, 2]))
            # the lease thread may register "a" after the subscriber's first registry poll,
            # so wait for the batch itself rather than for one synced poll
            await wait_until(lambda: index.last_seq("a") == 1)
            assert calls == []
            publish(3, stored([3]))  # batch 2 never made it
            publish(5, stored([5]))
            await wait_until(lambda: len(calls) == 2)
            # The first attempt failed: no stale entries are kept while waiting for the retry.
            assert sub.resync_failures == 1
            assert "a" not in index.workers() and index.match([H(1)], now=0.0) == {}
            retry_may_finish.set()
            await wait_until(lambda: index.last_seq("a") == 5)
            assert index.worker_blocks("a") == {H(7): frozenset({"host"}), H(5): frozenset({"device"})}
            assert sub.resyncs == 1 and len(calls) == 2
        finally:
            retry_may_finish.set()
            await sub.stop()
            lease.close()

    asyncio.run(main())


def test_injected_gap_is_always_resynced(shared_redis, cluster, rclient):
    """A forged stream entry that skips a seq (the publisher dropped one) forces a resync."""
    async def main():
        w = Worker(shared_redis.url, cluster, "a")
        calls = []

        async def resync(worker_id, address):
            calls.append(worker_id)
            return 9, [(H(50), None, "device"), (H(51), H(50), "disk")]

        index = ClusterIndex()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        sub.start()
        try:
            w.emit(stored([1]))
            assert w.pub.wait_published()
            await synced(sub, "a")
            key = stream_key("a", cluster)
            for seq in (3, 9, 10):  # 2 and 4..8 missing; 3 and 9 are covered by the snapshot
                data = encode_batch(EventBatch("a", seq, time.time(), [stored([seq])]))
                rclient.xadd(key, {"seq": str(seq), "epoch": w.pub.epoch, "data": data})
            await wait_until(lambda: index.last_seq("a") == 10)
            assert calls == ["a"]
            assert index.worker_blocks("a") == {H(50): frozenset({"device"}), H(51): frozenset({"disk"}),
                                                H(10): frozenset({"device"})}
        finally:
            await sub.stop()
            w.close()

    asyncio.run(main())


def test_restarted_worker_replaces_its_entries(shared_redis, cluster):
    async def main():
        old = Worker(shared_redis.url, cluster, "a")
        index = ClusterIndex()
        resync, calls = no_resync()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        sub.start()
        try:
            for i in range(4):
                old.emit(stored([i]))
                old.pub.flush_now()
            assert old.pub.wait_published()
            await synced(sub, "a")
            assert index.last_seq("a") == 4
            old.pub.close()  # crash and restart: a new process numbers from 1 again
            new = KVEventPublisher(shared_redis.url, "a", cluster=cluster, flush_interval_s=0.01)
            try:
                new.sink(stored([77]))
                assert new.wait_published()
                await wait_until(lambda: index.last_seq("a") == 1)
                assert index.worker_blocks("a") == {H(77): frozenset({"device"})}
                assert calls == []
            finally:
                new.close()
        finally:
            await sub.stop()
            old.close()

    asyncio.run(main())


# ---------------------------------------------------------------------- lease
def test_lapsed_lease_removes_the_workers_entries_within_ttl_plus_poll(shared_redis, cluster, rclient):
    """A dead worker's lease key expires in Redis ``ttl`` after its last heartbeat, and the
    subscriber drops its entries at the next registry poll after that. Counted in polls
    (the subscriber's own clock), not seconds, so a busy machine cannot stretch it."""
    ttl = 0.6

    async def main():
        a = Worker(shared_redis.url, cluster, "a", ttl_s=ttl, interval_s=0.1)
        b = Worker(shared_redis.url, cluster, "b")  # the survivor: a default lease, not starved out
        index = ClusterIndex()
        resync, calls = no_resync()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        sub.start()
        try:
            a.emit(stored([1, 2]))
            b.emit(stored([1]))
            assert a.pub.wait_published() and b.pub.wait_published()
            await wait_until(lambda: set(sub.live_workers()) == {"a", "b"}, timeout=30.0)  # first beats
            await sub.wait_synced(5.0)
            assert index.num_blocks("a") == 2
            a.close(delete=False)  # dies: no more heartbeats, the key just expires
            # within ttl: the last heartbeat set the key to expire at most ttl later (Redis's clock)
            left_ms = rclient.pttl(lease_key("a", cluster))  # -2: expired already, -1: never would
            assert left_ms == -2 or 0 < left_ms <= ttl * 1000, left_ms
            await wait_until(lambda: not rclient.exists(lease_key("a", cluster)), timeout=30.0)
            # plus one poll: a poll that started after the key expired no longer lists "a". The
            # poll under way now may have read the lease just before, so allow that one too.
            expired_at_poll = sub._polls
            await wait_until(lambda: "a" not in index.workers() or sub._polls >= expired_at_poll + 2,
                             timeout=30.0)
            assert "a" not in index.workers(), f"still indexed {sub._polls - expired_at_poll} polls after expiry"
            assert set(sub.live_workers()) == {"b"}
            assert index.holders(H(1)) == {"b": "device"} and index.num_blocks("a") == 0
            assert index.match([H(1), H(2)], now=0.0).keys() == {"b"}
            assert calls == []
        finally:
            await sub.stop()
            a.close()
            b.close()

    asyncio.run(main())


def test_stop_is_prompt_even_when_a_read_swallows_the_cancel(shared_redis, cluster):
    """redis-py's asyncio client can swallow a CancelledError during a blocking read
    (redis/redis-py#2028); injected here, ``stop`` must still end the subscriber promptly
    instead of leaving a task that never finishes (which also hangs ``asyncio.run``)."""
    async def main():
        index = ClusterIndex()
        resync, _ = no_resync()
        sub = IndexSubscriber(shared_redis.url, index, resync, cluster=cluster, poll_interval_s=POLL)
        real = sub._read_once
        swallowed = []
        inside = []

        async def swallowing(next_poll):
            inside.append(True)
            try:
                await real(next_poll)
            except asyncio.CancelledError:
                if swallowed:  # only the first: a failing test must still be able to end
                    raise
                swallowed.append(True)
            finally:
                inside.clear()

        sub._read_once = swallowing
        sub.start()
        await sub.wait_synced(5.0)
        backstop = time.monotonic() + 60.0  # only if the subscriber never reads at all
        while not inside:  # the loop is single-threaded: seen here, the task is parked in a read
            assert time.monotonic() < backstop, "the subscriber never entered a read"
            await asyncio.sleep(0.005)
        task = sub._task
        # stop's timeout is only a backstop: it ends at once when the task ends. A subscriber
        # that kept running after the lost cancel would be abandoned still running at it.
        await sub.stop(timeout=30.0)
        assert task.done(), "stop gave up on a subscriber task that was still running"
        assert swallowed == [True]  # the fault was injected: the cancel arrived during a read
        assert sub._task is None

    asyncio.run(main())


# ------------------------------------------------------------ duplicate worker ids
def test_a_second_process_under_a_live_workers_id_is_refused(shared_redis, cluster):
    """Two processes under one --worker-id would overwrite each other's lease and event
    stream (the router's index flips between them); the second one exits 2 before it
    publishes anything. A lease a dead worker left behind does not stop a restart."""
    import subprocess

    from kvmesh.services.procs import python_cmd
    from kvmesh.workers.kv_publisher import live_lease_holder

    live = WorkerLease(shared_redis.url, "wB", "127.0.0.1:1111", {}, lambda: {}, cluster=cluster,
                       ttl_s=3.0, interval_s=0.2)
    r = redis.Redis.from_url(shared_redis.url)
    try:
        deadline = time.monotonic() + 60  # against a hang only: waits for the first beat
        while not r.exists(lease_key("wB", cluster)):
            assert time.monotonic() < deadline, "the lease was never written"
            time.sleep(0.02)
        holder = live_lease_holder(shared_redis.url, "wB", cluster=cluster)
        assert holder is not None and holder["address"] == "127.0.0.1:1111"
        env = {**os.environ, "KVMESH_DUPLICATE_ID_WAIT_S": "2"}
        res = subprocess.run(python_cmd("worker", "--port", str(free_port()), "--worker-id", "wB", "--redis-url",
                                        shared_redis.url, "--cluster", cluster),
                             capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 2, res.stderr[-2000:]
        assert "--worker-id wB is in use" in res.stderr and "127.0.0.1:1111" in res.stderr
        assert r.xlen(stream_key("wB", cluster)) == 0  # it published nothing
    finally:
        live.close(delete=False)  # dies: the lease lapses, never renewed
        r.close()
    assert live_lease_holder(shared_redis.url, "wB", cluster=cluster, ttl_s=3.0, interval_s=0.2) is None
    assert live_lease_holder(shared_redis.url, "nobody", cluster=cluster) is None


def test_a_restart_waits_for_a_draining_predecessor(shared_redis, cluster, tmp_path):
    """Ray restarts an actor while the old process still drains (and renews its lease): the
    new worker waits for that lease to stop instead of refusing, then serves."""
    from kvmesh.services.procs import python_cmd, spawn, stop_process, wait_healthy

    old = WorkerLease(shared_redis.url, "wR", "127.0.0.1:2222", {}, lambda: {}, cluster=cluster,
                      ttl_s=3.0, interval_s=0.2)
    r = redis.Redis.from_url(shared_redis.url)
    proc = None
    try:
        deadline = time.monotonic() + 60  # against a hang only
        while not r.exists(lease_key("wR", cluster)):
            assert time.monotonic() < deadline, "the lease was never written"
            time.sleep(0.02)
        port = free_port()
        log = tmp_path / "wR.log"
        proc = spawn(python_cmd("--log-level", "INFO", "worker", "--port", str(port), "--worker-id", "wR",
                                "--redis-url", shared_redis.url, "--cluster", cluster), str(log))
        while "still renews its lease" not in log.read_text(errors="replace"):  # it saw the live lease
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        old.close()  # the predecessor finishes draining: its lease goes
        wait_healthy(f"127.0.0.1:{port}", proc=proc, timeout=120)
        assert proc.poll() is None
        deadline = time.monotonic() + 60
        while json.loads(r.get(lease_key("wR", cluster)) or "{}").get("address") != f"127.0.0.1:{port}":
            assert time.monotonic() < deadline, "the new worker never took the lease"
            time.sleep(0.05)
    finally:
        old.close()
        if proc is not None:
            stop_process(proc)
        r.close()


def test_a_lease_held_by_another_instance_is_never_overwritten(shared_redis, cluster, rclient):
    """Fencing: two processes under one worker id that both passed the start-up check (they
    started together, or one lost Redis past its TTL while a replacement took the id). The
    second's beat finds the first's lease, writes nothing, stops beating and reports it once;
    closing it leaves the first's lease in place."""
    first = WorkerLease(shared_redis.url, "wF", "10.0.0.1:5000", {}, dict, cluster=cluster, ttl_s=3.0, interval_s=0.1)
    reports = []
    second = None
    try:
        deadline = time.monotonic() + 60  # against a hang only: waits for the first beat
        while not rclient.exists(lease_key("wF", cluster)):
            assert time.monotonic() < deadline, "the lease was never written"
            time.sleep(0.02)
        assert json.loads(rclient.get(lease_key("wF", cluster)))["instance"] == first.instance
        second = WorkerLease(shared_redis.url, "wF", "10.0.0.2:5000", {}, dict, cluster=cluster, ttl_s=3.0,
                             interval_s=0.1, on_lost=reports.append)
        second._thread.join(timeout=60)  # its heartbeat ends on the first beat
        assert not second._thread.is_alive()
        assert [r["address"] for r in reports] == ["10.0.0.1:5000"] and second.lost_to["instance"] == first.instance
        assert second.beat() is False  # and stays refused while the first renews
        second.close()
        lease = json.loads(rclient.get(lease_key("wF", cluster)))
        assert lease["address"] == "10.0.0.1:5000" and lease["instance"] == first.instance
    finally:
        if second is not None:
            second.close()
        first.close()
    assert rclient.get(lease_key("wF", cluster)) is None  # its own lease, deleted on close


def test_a_worker_whose_id_another_process_takes_stops_with_exit_1(shared_redis, cluster, tmp_path):
    """A real worker process; then a lease under its id from another instance (written as a
    replacement would write it, renewed faster than the worker's TTL): the worker stops
    serving, exits 1 and says why, and leaves the other's lease alone."""
    from kvmesh.services.procs import python_cmd, spawn, stop_process, wait_healthy

    port = free_port()
    log = tmp_path / "wT.log"
    proc = spawn(python_cmd("worker", "--port", str(port), "--worker-id", "wT", "--threads", "1",
                            "--num-blocks", "64", "--redis-url", shared_redis.url, "--cluster", cluster), str(log))
    r = redis.Redis.from_url(shared_redis.url)
    other = json.dumps({"worker_id": "wT", "address": "10.9.9.9:5000", "instance": "another-process"})
    try:
        wait_healthy(f"127.0.0.1:{port}", proc=proc, timeout=120)
        deadline = time.monotonic() + 120  # against a hang only
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the worker kept serving under a taken id"
            r.set(lease_key("wT", cluster), other, px=3000)
            time.sleep(0.2)
        text = log.read_text(errors="replace")
        assert proc.returncode == 1, text[-2000:]
        assert "another process took --worker-id wT's lease" in text and "10.9.9.9:5000" in text
        assert json.loads(r.get(lease_key("wT", cluster)))["instance"] == "another-process"
    finally:
        if proc.poll() is None:
            stop_process(proc)
        r.close()


def test_a_lease_that_cannot_be_renewed_is_reported_once_not_every_beat(monkeypatch, caplog):
    """Redis down: the heartbeat keeps trying every interval but warns once per 30 s, and
    says when it is renewed again."""
    import logging

    beats = []

    def beat(self):  # fault injection: Redis refuses five times, then answers
        beats.append(1)
        if len(beats) <= 5:
            raise redis.ConnectionError("Connection refused")
        return True

    monkeypatch.setattr(WorkerLease, "beat", beat)
    caplog.set_level(logging.WARNING, logger="kvmesh.workers.kv_publisher")
    lease = WorkerLease("redis://127.0.0.1:1", "wD", "127.0.0.1:1", {}, dict, ttl_s=3.0, interval_s=0.01)
    try:
        deadline = time.monotonic() + 60  # against a hang only
        while len(beats) < 7:
            assert time.monotonic() < deadline, "the heartbeat stopped"
            time.sleep(0.01)
    finally:
        lease.close(delete=False)
    lines = [r.getMessage() for r in caplog.records if "wD" in r.getMessage()]
    assert [line for line in lines if "not renewed" in line] == [
        "lease of wD not renewed (1 attempt(s) so far): Connection refused"]
    assert "lease of wD renewed again after 5 failed attempt(s)" in lines


def test_a_publisher_under_a_taken_id_never_touches_the_holders_stream(shared_redis, cluster, rclient):
    """Fencing of the event stream: the holder of worker id "wS" has published a batch; a
    second process under the same id (started together, or back from a Redis outage after a
    replacement took the id) neither trims that stream nor appends to it, stops, and drops
    what it held. The holder's own publisher, with the lease's instance, writes as usual."""
    holder = WorkerLease(shared_redis.url, "wS", "10.0.0.1:5000", {}, dict, cluster=cluster, ttl_s=3.0,
                         interval_s=0.1)
    mine = KVEventPublisher(shared_redis.url, "wS", cluster=cluster, flush_interval_s=0.01,
                            instance=holder.instance)
    other = None
    try:
        deadline = time.monotonic() + 60  # against a hang only
        while not rclient.exists(lease_key("wS", cluster)):
            assert time.monotonic() < deadline, "the lease was never written"
            time.sleep(0.02)
        mine.sink(stored([1, 2]))
        assert mine.wait_published(30)
        before = rclient.xrange(stream_key("wS", cluster))
        assert [e[b"epoch"].decode() for _, e in before] == [mine.epoch]
        other = KVEventPublisher(shared_redis.url, "wS", cluster=cluster, flush_interval_s=0.01,
                                 instance="another-process")
        other.sink(stored([3]))
        while not other.fenced:
            assert time.monotonic() < deadline, "the second publisher was never fenced"
            time.sleep(0.02)
        assert rclient.xrange(stream_key("wS", cluster)) == before  # not trimmed, nothing appended
        assert other.wait_published(5)  # what it held was dropped, not left waiting
        mine.sink(stored([4]))
        assert mine.wait_published(30)
        assert len(rclient.xrange(stream_key("wS", cluster))) == 2
    finally:
        if other is not None:
            other.close()
        mine.close()
        holder.close()
