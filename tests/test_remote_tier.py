"""Remote tier on a real redis-server: round trip, runs, LRU and cap shared by a cluster,
damage detected and dropped with the accounting corrected, Redis failures never raised,
concurrent writers never pushing the tier over its cap."""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.cache_store.block_record import HEADER_BYTES, encode_record
from kvmesh.cache_store.remote_tier import (TAG_BYTES, RemoteTier, block_key, bytes_key, cap_key, lengths_key, lru_key,
                                            record_key_from_file)
from kvmesh.services.procs import free_port
from tests.test_disk_tier import items  # a chain of n (meta, payload) records

SHAPE = (4, 2, 2, 16, 64)
PAYLOAD = 4096
REC = HEADER_BYTES + 16 * 4 + PAYLOAD  # bytes of one record with a PAYLOAD-byte payload


def hashes(its):
    return [m.block_hash for m, _ in its]


def connect(url, timeout=2.0, **kw):
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, **kw)


@pytest.fixture()
def raw(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()


@pytest.fixture()
def new_tier(redis_server):
    clients = []

    def make(cap=1 << 30, cluster="default", **kw):
        c = connect(redis_server.url)
        clients.append(c)
        return RemoteTier(c, cap, cluster, **kw)

    yield make
    for c in clients:
        c.close()


def used(raw, cluster="default"):
    return int(raw.get(bytes_key(cluster)) or 0)


def check_accounting(raw, cluster="default"):
    """Byte counter == sum of STRLEN of the block keys == sum of the lengths hash; the LRU,
    the lengths hash and the block keys name the same blocks. Returns the byte counter."""
    keys = list(raw.scan_iter(match=f"kvmesh:{cluster}:kv:*", count=1000))
    names = {k.rsplit(b":", 1)[1] for k in keys}
    assert set(raw.zrange(lru_key(cluster), 0, -1)) == names
    lens = raw.hgetall(lengths_key(cluster))
    assert set(lens) == names
    strlen = sum(raw.strlen(k) for k in keys)
    assert sum(int(v) for v in lens.values()) == strlen == used(raw, cluster)
    return strlen


def test_roundtrip_identical_bytes_and_meta(new_tier, raw):
    t = new_tier()
    its = items(3) + items(1, seed=9, size=1 << 20)  # one 1 MiB payload, passed as a memoryview
    its[-1] = (its[-1][0], memoryview(bytearray(its[-1][1])))
    assert t.put_many(its) == (4, [])
    got = t.get_run(hashes(its))
    assert [m for m, _ in got] == [m for m, _ in its]
    assert [bytes(p) for _, p in got] == [bytes(p) for _, p in its]
    # the stored value is exactly block_record's encoding
    assert raw.get(block_key(its[0][0].block_hash)) == encode_record(*its[0])
    s = t.stats()
    assert s["remote_blocks"] == 4 and s["remote_hits"] == 4 and s["remote_stored"] == 4
    assert s["remote_bytes"] == sum(m.record_len for m, _ in its) == check_accounting(raw)
    assert s["remote_capacity_bytes"] == 1 << 30


def test_get_run_stops_at_first_missing(new_tier):
    t = new_tier()
    its = items(5)
    t.put_many(its[:2] + its[3:])
    assert t.contains(hashes(its)) == [True, True, False, True, True]
    assert [m for m, _ in t.get_run(hashes(its))] == [m for m, _ in its[:2]]
    assert t.get_run(hashes(its[2:])) == []
    assert t.get_run([]) == []


def test_present_records_only_touched(new_tier, raw):
    t = new_tier()
    its = items(3)
    t.put_many(its)
    before = used(raw)
    scores = [raw.zscore(lru_key(), m.block_hash.hex()) for m, _ in its]
    other = [(m, bytes(len(p))) for m, p in its]  # same blocks, different bytes: not written
    assert t.put_many(other) == (0, [])
    assert used(raw) == before == 3 * REC
    assert all(raw.zscore(lru_key(), m.block_hash.hex()) > s for (m, _), s in zip(its, scores))
    assert [bytes(p) for _, p in t.get_run(hashes(its))] == [p for _, p in its]
    assert t.stats()["remote_present"] == 3
    check_accounting(raw)


def test_cap_exact_and_lru_respects_reads(new_tier, raw):
    t = new_tier(cap=3 * REC)
    a, b, c, d, e = items(5)
    for it in (a, b, c):
        assert t.put_many([it]) == (1, [])
    assert used(raw) == 3 * REC  # exactly at the cap is allowed
    assert len(t.get_run([a[0].block_hash])) == 1  # a is now the most recent
    assert t.put_many([d]) == (1, [b[0].block_hash])  # b is the least recently used
    assert t.contains(hashes([a, b, c, d])) == [True, False, True, True]
    # one read of a run stamps its tail oldest: d goes before c before a
    assert len(t.get_run(hashes([a, c, d]))) == 3
    assert t.put_many([e]) == (1, [d[0].block_hash])
    assert used(raw) == 3 * REC and check_accounting(raw) == 3 * REC


def test_batch_larger_than_cap_keeps_its_head(new_tier, raw):
    t = new_tier(cap=3 * REC)
    its = items(5)
    stored, evicted = t.put_many(its)
    assert stored == 5 and evicted == [its[4][0].block_hash, its[3][0].block_hash]
    assert len(t.get_run(hashes(its))) == 3
    assert check_accounting(raw) == 3 * REC


def test_chunked_put_and_read(new_tier, raw):
    t = new_tier(cap=5 * REC, max_batch_bytes=2 * REC)  # 7 records: 4 put scripts
    its = items(7)
    stored, evicted = t.put_many(its)
    assert stored == 7 and set(evicted) == {its[5][0].block_hash, its[6][0].block_hash}
    scores = [raw.zscore(lru_key(), m.block_hash.hex()) for m, _ in its[:5]]
    assert scores == sorted(scores, reverse=True)  # stamps decrease along the records
    got = t.get_run(hashes(its))  # read in MGETs of about 2 records
    assert [m for m, _ in got] == [m for m, _ in its[:5]]
    assert check_accounting(raw) == 5 * REC


def test_record_larger_than_cap_refused(new_tier, raw):
    t = new_tier(cap=REC + 100)
    small, big = items(1)[0], items(1, seed=1, size=PAYLOAD + 101)[0]
    assert t.put_many([big]) == (0, [])
    assert t.put_many([big, small]) == (1, [])
    assert t.contains(hashes([big, small])) == [False, True]
    assert t.stats()["remote_refused"] == 2
    assert check_accounting(raw) == REC


def test_bad_arguments():
    c = redis.Redis(port=free_port())
    for cap in (0, -1):
        with pytest.raises(ValueError, match="capacity must be > 0 bytes"):
            RemoteTier(c, cap)
    with pytest.raises(ValueError, match="max_batch_bytes"):
        RemoteTier(c, 1 << 20, max_batch_bytes=0)
    with pytest.raises(ValueError, match="decode_responses"):
        RemoteTier(redis.Redis(port=free_port(), decode_responses=True), 1 << 20)


def test_payload_length_mismatch_raises_before_sending(new_tier, raw):
    t = new_tier()
    (meta, payload), = items(1)
    with pytest.raises(ValueError, match="payload has"):
        t.put_many([(meta, payload[:-1])])
    assert not t.contains([meta.block_hash])[0] and used(raw) == 0


def test_workers_share_a_cluster_and_clusters_are_separate(new_tier, raw):
    w1, w2, other = new_tier(), new_tier(), new_tier(cluster="b")
    its = items(3)
    assert w1.put_many(its) == (3, [])
    assert [m for m, _ in w2.get_run(hashes(its))] == [m for m, _ in its]
    assert w2.put_many(its) == (0, [])
    assert other.get_run(hashes(its)) == [] and other.contains(hashes(its)) == [False] * 3
    assert other.put_many(its[:1]) == (1, [])
    assert used(raw) == 3 * REC and used(raw, "b") == REC
    check_accounting(raw)
    check_accounting(raw, "b")


def test_cap_of_the_first_writer_is_the_clusters(new_tier, raw, caplog):
    big, small = new_tier(cap=4 * REC), new_tier(cap=2 * REC)
    its = items(6)
    big.put_many(its[:4])
    assert int(raw.get(cap_key())) == 4 * REC
    with caplog.at_level("WARNING", logger="kvmesh.cache_store.remote_tier"):
        stored, evicted = small.put_many(its[4:5])  # a worker set up smaller does not empty the tier
    assert stored == 1 and evicted == [its[3][0].block_hash]  # the oldest stamp: the first put's tail
    assert small.capacity_bytes == 4 * REC and "cluster's cap is" in caplog.text
    assert check_accounting(raw) == 4 * REC
    raw.set(cap_key(), 2 * REC)  # the operator's way to change it
    stored, evicted = big.put_many(its[5:])
    assert stored == 1 and len(evicted) == 3 and big.capacity_bytes == 2 * REC
    assert check_accounting(raw) == 2 * REC


def _flip_payload(v, other):
    return v[:-10] + bytes([v[-10] ^ 1]) + v[-9:]


def _flip_header(v, other):
    return v[:20] + bytes([v[20] ^ 0x80]) + v[21:]


def _truncate(v, other):
    return v[:-100]


def _header_only(v, other):
    return v[:40]


def _wrong_block(v, other):
    return other  # a valid record of another block, stored under this hash


@pytest.mark.parametrize("damage", [_flip_payload, _flip_header, _truncate, _header_only, _wrong_block])
def test_damaged_record_dropped_and_counters_corrected(new_tier, raw, damage):
    t = new_tier()
    its = items(4)
    t.put_many(its)
    key = block_key(its[2][0].block_hash)
    raw.set(key, damage(raw.get(key), raw.get(block_key(its[3][0].block_hash))))
    got = t.get_run(hashes(its))
    assert [m for m, _ in got] == [m for m, _ in its[:2]]
    assert not raw.exists(key)
    assert t.stats()["remote_damaged"] == 1 and t.stats()["remote_blocks"] == 3
    assert check_accounting(raw) == 3 * REC
    assert t.put_many(its) == (1, [])  # stored again, the whole run is back
    assert len(t.get_run(hashes(its))) == 4
    assert check_accounting(raw) == 4 * REC


def test_damage_seen_in_transit_keeps_the_good_record(new_tier, raw):
    t = new_tier()
    its = items(2)
    t.put_many(its)
    real_mget = t.client.mget

    def corrupt_reply(keys):  # fault injection: the reply is damaged, the record in Redis is fine
        values = real_mget(keys)
        return [v[:-1] if v is not None else None for v in values]

    t.client.mget = corrupt_reply
    assert t.get_run(hashes(its)) == []
    assert t.stats()["remote_damaged"] == 1
    del t.client.mget
    assert len(t.get_run(hashes(its))) == 2  # the drop compared the value and left it alone
    check_accounting(raw)


def test_key_lost_behind_the_tiers_back(new_tier, raw):
    t = new_tier(cap=3 * REC)
    its = items(4)
    t.put_many(its[:3])
    raw.delete(block_key(its[1][0].block_hash))  # as Redis's maxmemory eviction would
    assert len(t.get_run(hashes(its))) == 1
    assert t.put_many(its[1:2]) == (1, [])  # stored again; the lost bytes are not counted twice
    assert t.put_many(its[3:]) == (1, [its[2][0].block_hash])
    assert check_accounting(raw) == 3 * REC


def _fast_failing_client(port, timeout=0.2):
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                       retry=Retry(NoBackoff(), 0))


def _assert_fails_soft(t, its):
    before = t.stats()
    start = time.monotonic()
    assert t.get_run(hashes(its)) == []
    assert t.put_many(its) == (0, [])
    assert t.contains(hashes(its)) == [False] * len(its)
    s = t.stats()
    assert time.monotonic() - start < 3.0
    assert s["remote_blocks"] is None and s["remote_bytes"] is None
    assert s["remote_errors"] - before["remote_errors"] == 4  # get_run, put, contains, stats
    assert s["remote_stored"] == before["remote_stored"] and s["remote_hits"] == before["remote_hits"]


def test_unreachable_redis_returns_misses_quickly():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _assert_fails_soft(RemoteTier(_fast_failing_client(port), 1 << 20, cooldown_s=0), items(2))


def test_stalled_redis_bounded_by_socket_timeout():
    with socket.socket() as s:  # accepts connections (kernel backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        _assert_fails_soft(RemoteTier(_fast_failing_client(s.getsockname()[1]), 1 << 20, cooldown_s=0), items(2))


def test_redis_stopped_under_a_working_tier(redis_server):
    c = redis.Redis.from_url(redis_server.url, socket_timeout=0.2, socket_connect_timeout=0.2,
                             retry=Retry(NoBackoff(), 0))
    t = RemoteTier(c, 1 << 20, cooldown_s=0)
    its = items(2)
    assert t.put_many(its) == (2, [])
    redis_server.stop()
    _assert_fails_soft(t, its)


def test_silent_redis_costs_one_timeout_per_cooldown():
    """After one call times out, the tier answers misses at once for cooldown_s instead of
    making every caller wait for its own timeout; then it tries Redis again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        t = RemoteTier(_fast_failing_client(s.getsockname()[1], timeout=0.3), 1 << 20, cooldown_s=1.0)
        its = items(2)
        start = time.monotonic()
        assert t.get_run(hashes(its)) == []  # waits one timeout
        first = time.monotonic() - start
        assert first >= 0.25  # it did wait for the timeout
        for _ in range(20):
            assert t.get_run(hashes(its)) == [] and t.put_many(its) == (0, [])
            assert t.contains(hashes(its)) == [False, False]
        # answered at once: counted, not timed -- none of these 60 calls (nor stats) reached
        # Redis, so none could wait for it; the only error is the first call's timeout
        st = t.stats()
        assert st["remote_errors"] == 1 and st["remote_skipped"] == 61 and st["remote_blocks"] is None
        time.sleep(1.0)
        start = time.monotonic()
        assert t.get_run(hashes(its)) == []  # cooled down: tried (and timed out) again
        assert time.monotonic() - start >= 0.25 and t.stats()["remote_errors"] == 2


def test_concurrent_writers_never_exceed_cap(new_tier, raw):
    cap = 10 * REC
    pool = items(60, seed=3)
    workers = [new_tier(cap=cap, max_batch_bytes=(2 + i % 3) * REC) for i in range(6)]
    results: list[tuple[int, list[bytes]]] = []
    peak = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(t, seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                start = rng.randrange(len(pool) - 5)
                res = t.put_many(pool[start:start + rng.randrange(1, 6)])
                with lock:
                    results.append(res)
                t.get_run(hashes(pool[start:start + 3]))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], used(raw))

    lock = threading.Lock()
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=write, args=(t, i)) for i, t in enumerate(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    watcher.join()
    assert not errors
    assert 0 < peak[0] <= cap
    remaining = check_accounting(raw)
    assert remaining <= cap
    # every block stored was either evicted exactly once or is still there
    stored = sum(n for n, _ in results)
    evicted = sum(len(e) for _, e in results)
    assert stored - evicted == raw.zcard(lru_key()) == remaining // REC
    assert sum(t.stats()["remote_errors"] for t in workers) == 0


def test_clear(new_tier, raw):
    a, b = new_tier(), new_tier(cluster="b")
    its = items(5)
    a.put_many(its)
    b.put_many(its[:2])
    stray = items(1, seed=5)[0]
    raw.set(block_key(stray[0].block_hash), encode_record(*stray))  # written outside the tier
    assert a.clear() == 6
    assert list(raw.scan_iter(match="kvmesh:default:kv:*")) == []
    assert raw.zcard(lru_key()) == 0 and raw.hlen(lengths_key()) == 0 and used(raw) == 0
    assert a.get_run(hashes(its)) == [] and a.stats()["remote_blocks"] == 0
    assert len(b.get_run(hashes(its))) == 2 and check_accounting(raw, "b") == 2 * REC
    assert a.clear() == 0


def test_eviction_is_fair_between_tenants(new_tier, raw):
    """A cap of 10 records, shared by the cluster. Tenant "a" stores 4; tenant "b" then puts
    20 (several workers' worth of a flood): b's own oldest records are evicted, never a's,
    whose 4 stay readable; the accounting per tenant adds up. Tenant-less records (open
    mode) share one LRU as before."""
    from kvmesh.cache_store.remote_tier import tenant_bytes_key

    cluster = "fair"
    t = new_tier(cap=10 * REC, cluster=cluster)
    a = items(4, seed=1)
    assert t.put_many(a, tenants=["a"] * 4) == (4, [])
    b = items(20, seed=2)
    evicted = []
    for k in range(0, 20, 5):
        evicted += t.put_many(b[k:k + 5], tenants=["b"] * 5)[1]
    assert len(evicted) == 14 and set(evicted) <= set(hashes(b))
    assert [m for m, _ in t.get_run(hashes(a))] == [m for m, _ in a]  # all of a's still there
    assert {k: int(v) for k, v in raw.hgetall(tenant_bytes_key(cluster)).items()} == {b"a": 4 * REC, b"b": 6 * REC}
    assert used(raw, cluster) == 10 * REC
    assert t.stats()["remote_blocks"] == 10
    t.clear()
    assert used(raw, cluster) == 0 and not raw.exists(tenant_bytes_key(cluster))


KEY = bytes(range(32))


def test_keyed_records_carry_a_mac_and_round_trip(new_tier, raw):
    t = new_tier(record_key=KEY)
    its = items(3)
    assert t.put_many(its) == (3, [])
    value = raw.get(block_key(its[0][0].block_hash))
    assert len(value) == REC + TAG_BYTES and value[:REC] == encode_record(*its[0])
    got = t.get_run(hashes(its))
    assert [m for m, _ in got] == [m for m, _ in its] and [bytes(p) for _, p in got] == [bytes(p) for _, p in its]
    assert check_accounting(raw) == 3 * (REC + TAG_BYTES)  # the cap counts the MAC too


@pytest.mark.parametrize("writer_key, reader_key", [(None, KEY), (KEY, None), (KEY, bytes(32))],
                         ids=["unkeyed-writer", "unkeyed-reader", "other-key"])
def test_a_record_without_the_readers_mac_is_dropped(new_tier, raw, writer_key, reader_key):
    its = items(2)
    new_tier(record_key=writer_key).put_many(its)
    reader = new_tier(record_key=reader_key)
    assert reader.get_run(hashes(its)) == []
    assert reader.stats()["remote_damaged"] == 1
    assert raw.get(block_key(its[0][0].block_hash)) is None  # deleted, so the real block can be stored again
    check_accounting(raw)


def test_a_forged_record_with_valid_checksums_is_refused_with_a_key(new_tier, raw):
    """Someone with write access to Redis (not to the key) stores a record whose KV is all
    zeros and whose checksums are right; the unkeyed checks pass it, the MAC does not."""
    from kvmesh.cache_store.block_record import checksum, decode_record

    its = items(2)
    keyed = new_tier(record_key=KEY)
    keyed.put_many(its)
    k = block_key(its[0][0].block_hash)
    meta, payload = decode_record(raw.get(k)[:-TAG_BYTES])
    zeros = bytes(len(payload))
    forged = encode_record(meta._replace(payload_checksum=checksum(zeros)), zeros)
    assert decode_record(forged)[0].block_hash == meta.block_hash  # passes every unkeyed check
    for tag in (b"", bytes(TAG_BYTES), raw.get(k)[-TAG_BYTES:]):  # no MAC, a zero one, the real record's
        raw.set(k, forged + tag)
        assert keyed.get_run(hashes(its)) == []
    assert keyed.put_many(its)[0] == 1  # the forged record was dropped: the real one is stored again
    assert [bytes(p) for _, p in keyed.get_run(hashes(its))] == [bytes(p) for _, p in its]


def test_record_key_checks(tmp_path, redis_server):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RemoteTier(connect(redis_server.url), 1 << 20, record_key=b"short")
    f = tmp_path / "record.key"
    f.write_text("0123456789abcdef" * 4 + "\n")
    assert record_key_from_file(str(f)) == record_key_from_file(str(f))
    assert len(record_key_from_file(str(f))) == 32
    f.write_text("tooshort\n")
    with pytest.raises(ValueError, match="at least 32"):
        record_key_from_file(str(f))
    with pytest.raises(ValueError, match="cannot read"):
        record_key_from_file(str(tmp_path / "missing"))


def test_a_keyed_record_copied_to_another_namespace_does_not_verify(new_tier, raw):
    """Workers of another KV producer (other kernels or hardware) use other keys in Redis;
    a record copied there by someone who can write to Redis is not loaded."""
    its = items(1)
    a, b = new_tier(cluster="c.prodA", record_key=KEY), new_tier(cluster="c.prodB", record_key=KEY)
    a.put_many(its)
    h = its[0][0].block_hash
    raw.set(block_key(h, "c.prodB"), raw.get(block_key(h, "c.prodA")))
    assert b.get_run([h]) == [] and b.stats()["remote_damaged"] == 1
    assert len(a.get_run([h])) == 1  # still good where it was written
