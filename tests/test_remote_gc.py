"""Remote-tier garbage collection on a real redis-server: a namespace whose KV producer no
live lease names is deleted after the grace and not before; a named one is kept; only
remote-tier keys go (leases, streams, other clusters' keys stay); one pass of a cluster at a
time; a Redis that fails never raises."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.cache_store.remote_gc import RemoteGC, gc_lock_key, gc_state_key
from kvmesh.cache_store.remote_tier import RemoteTier
from kvmesh.workers.kv_publisher import WorkerLease, lease_key, stream_key, workers_key
from kvmesh.workers.model_identity import producer_tag
from tests.test_disk_tier import items  # a chain of n (meta, payload) records
from tests.test_remote_tier import connect, raw  # noqa: F401 (raw: a fixture)

LIVE = "cpu avx2, 1 thread, torch 2.13.0, kernel"  # the producer the live workers name
OLD = "cpu avx2, torch 2.12.0, kernel"  # the producer of the fleet before an upgrade
LIVE_TAG, OLD_TAG = producer_tag(LIVE), producer_tag(OLD)


@pytest.fixture()
def new_gc(raw):
    made = []

    def make(cluster="c", grace_s=30.0, **kw):
        kw.setdefault("pause_s", 0.0)
        kw.setdefault("interval_s", 0.05)
        gc = RemoteGC(raw, cluster, grace_s=grace_s, **kw)
        made.append(gc)
        return gc

    yield make
    for gc in made:
        gc.stop()


def fill(raw, namespace, n=4, seed=0, tenant=None):
    """Put ``n`` records in the remote tier under ``kvmesh:{namespace}:``."""
    tier = RemoteTier(raw, 1 << 30, namespace)
    assert tier.put_many(items(n, seed=seed), tenants=[tenant] * n if tenant else None)[0] == n
    return tier


def keys(raw, pattern="*"):
    return sorted(k.decode() for k in raw.scan_iter(match=pattern, count=1000))


def ns_keys(raw, namespace):
    return keys(raw, f"kvmesh:{namespace}:kv*")


def add_lease(raw, worker_id, cluster="c", **fields):
    raw.sadd(workers_key(cluster), worker_id)
    raw.set(lease_key(worker_id, cluster), json.dumps({"worker_id": worker_id, **fields}), px=120_000)


def until(pred, timeout=30.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not true within {timeout} s")


def test_abandoned_namespace_is_kept_through_the_grace(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{LIVE_TAG}")
    fill(raw, f"c.{OLD_TAG}", seed=1)
    before = keys(raw)
    gc = new_gc(grace_s=60.0)
    first = gc.run_once(force=True)
    second = gc.run_once(force=True)
    assert first.ran and second.ran and first.deleted == second.deleted == {}
    assert set(second.waiting) == {f"c.{OLD_TAG}"} and 0 < second.waiting[f"c.{OLD_TAG}"] <= 60
    state = raw.hgetall(gc_state_key("c"))
    assert list(state) == [f"c.{OLD_TAG}".encode()]  # recorded, with Redis's clock
    assert set(keys(raw)) - set(before) == {gc_state_key("c"), "kvmesh:c:remote-gc-recent"}


def test_abandoned_namespace_is_deleted_after_the_grace(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{LIVE_TAG}")
    fill(raw, f"c.{OLD_TAG}", seed=1, n=6, tenant="t1")  # a tenant's own LRU and the owners hash too
    live = ns_keys(raw, f"c.{LIVE_TAG}")
    old = ns_keys(raw, f"c.{OLD_TAG}")
    assert f"kvmesh:c.{OLD_TAG}:kv-lru:t1" in old and f"kvmesh:c.{OLD_TAG}:kv-owner" in old
    deleted = []
    gc = new_gc(grace_s=1.0, on_deleted=deleted.append)
    start = time.monotonic()
    results = []

    def gone():
        results.append(gc.run_once(force=True))
        return not ns_keys(raw, f"c.{OLD_TAG}")

    until(gone)
    assert time.monotonic() - start >= 0.9  # not before the grace (Redis's clock against ours)
    assert results[0].deleted == {} and results[-1].deleted == {f"c.{OLD_TAG}": len(old)}
    assert sum(deleted) == len(old)
    assert ns_keys(raw, f"c.{LIVE_TAG}") == live
    assert raw.get(lease_key("w1", "c")) is not None and raw.smembers(workers_key("c")) == {b"w1"}
    assert not raw.exists(gc_state_key("c")) and not raw.exists(gc_lock_key("c"))


def test_a_live_lease_keeps_its_producers_namespace(redis_server, raw, new_gc):
    fill(raw, f"c.{LIVE_TAG}")
    fill(raw, f"c.{LIVE_TAG}.k0123abcd", seed=1)  # the same producer with a record key
    kept = ns_keys(raw, f"c.{LIVE_TAG}*")
    lease = WorkerLease(redis_server.url, "w1", "127.0.0.1:1", {"kv_producer": LIVE}, lambda: {}, cluster="c")
    try:
        until(lambda: raw.exists(lease_key("w1", "c")))
        gc = new_gc(grace_s=0.3)
        start = time.monotonic()
        while time.monotonic() - start < 1.5:  # passes well past the grace
            res = gc.run_once(force=True)
            assert res.ran and res.deleted == {} and res.waiting == {}
            time.sleep(0.05)
        assert ns_keys(raw, f"c.{LIVE_TAG}*") == kept
    finally:
        lease.close()  # the fleet moved on: the lease is gone
    until(lambda: (gc.run_once(force=True), not ns_keys(raw, f"c.{LIVE_TAG}*"))[1])
    assert not raw.exists(gc_state_key("c"))


def test_a_lease_without_a_producer_keeps_the_untagged_namespace(raw, new_gc):
    add_lease(raw, "old-worker")  # a worker from before KV producers: it uses kvmesh:c:
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, "c")
    fill(raw, f"c.{OLD_TAG}", seed=1)
    legacy = ns_keys(raw, "c")
    gc = new_gc(grace_s=0.3)
    until(lambda: gc.run_once(force=True).deleted)
    assert ns_keys(raw, "c") == legacy and not ns_keys(raw, f"c.{OLD_TAG}")


def test_an_unreadable_lease_stops_every_deletion(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{OLD_TAG}")
    raw.sadd(workers_key("c"), "w2")
    raw.set(lease_key("w2", "c"), b"{not json", px=120_000)
    gc = new_gc(grace_s=0.2)
    for _ in range(5):
        res = gc.run_once(force=True)
        assert res.ran and res.deleted == {} and res.error == "a live lease is not readable"
        time.sleep(0.1)
    assert ns_keys(raw, f"c.{OLD_TAG}")


def test_only_remote_tier_keys_of_the_cluster_are_deleted(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    raw.xadd(stream_key("w1", "c"), {"seq": 1, "epoch": "e", "data": b""})
    others = {
        "kvmesh:c:router-load": "x", "kvmesh:c:ratelimit/t/1": "3", "kvmesh:c:kv-other": "x",
        "kvmesh:c:kv:" + "0" * 31: "not a block key", "kvmesh:c:kv:" + "A" * 32: "upper case",
        "kvmesh:c:kvx": "x", "kvmesh:c.eu:kv-clock": "7", "kvmesh:cc:kv-clock": "7", "kvmesh:d:kv-lru": "x",
        f"kvmesh:c.{OLD_TAG}:worker:kv-lru": "x", "other:c:kv-lru": "x",
    }
    for k, v in others.items():
        raw.set(k, v)
    fill(raw, "c", tenant="t1")  # the untagged namespace of before producers
    fill(raw, f"c.{OLD_TAG}", seed=1)
    fill(raw, f"c.{OLD_TAG}.k0123abcd", seed=2)
    fill(raw, f"d.{OLD_TAG}", seed=3)  # another cluster's, of the same old producer
    # a cluster named "c.<8 hex digits>": its keys look like a namespace of c, but are not
    raw.sadd(workers_key(f"c.{producer_tag('x')}"), "w9")
    fill(raw, f"c.{producer_tag('x')}", seed=4)
    doomed = ns_keys(raw, "c") + ns_keys(raw, f"c.{OLD_TAG}") + ns_keys(raw, f"c.{OLD_TAG}.k0123abcd")
    doomed = [k for k in doomed if k not in others]
    before = keys(raw)
    gc = new_gc(grace_s=0.3)
    until(lambda: gc.run_once(force=True).deleted)
    assert sorted(set(before) - set(keys(raw))) == sorted(doomed)
    assert "kvmesh:c:kv-lru:t1" in doomed and "kvmesh:c:kv-cap" in doomed
    for k, v in others.items():
        assert raw.get(k) == v.encode(), k


def test_a_namespace_in_use_without_a_lease_is_kept(raw, new_gc):
    """Reads and writes move the namespace's kv-clock: the grace starts over."""
    add_lease(raw, "w1", kv_producer=LIVE)
    tier = fill(raw, f"c.{OLD_TAG}")
    gc = new_gc(grace_s=1.0)
    gc.run_once(force=True)
    start = time.monotonic()
    while time.monotonic() - start < 2.5:
        tier.get_run([m.block_hash for m, _ in items(2)])  # someone still reads it
        res = gc.run_once(force=True)
        assert res.deleted == {} and f"c.{OLD_TAG}" in res.waiting
        time.sleep(0.1)
    until(lambda: gc.run_once(force=True).deleted)  # left alone, it goes


def test_one_pass_at_a_time(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{OLD_TAG}")
    raw.mset({f"kvmesh:c.{OLD_TAG}:kv:{i:032x}": b"x" for i in range(300)})
    total = len(ns_keys(raw, f"c.{OLD_TAG}"))
    inside, go_on = threading.Event(), threading.Event()

    class Held(RemoteGC):
        def _delete(self, ns, st):
            inside.set()
            assert go_on.wait(30)
            return super()._delete(ns, st)

    counts = {"a": [], "b": []}
    # a's interval is long: the mark of its pass holds the cluster's next unforced pass back
    a = Held(raw, "c", grace_s=0.3, pause_s=0.0, interval_s=60, unlink_batch=7, on_deleted=counts["a"].append)
    b = new_gc(grace_s=0.3, unlink_batch=7, on_deleted=counts["b"].append)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", until(lambda: a.run_once(force=True).deleted)))
    t.start()
    try:
        assert inside.wait(30)  # a holds the lock and is about to delete
        assert raw.get(gc_lock_key("c")) is not None
        res = b.run_once(force=True)
        assert not res.ran and res.deleted == {}
    finally:
        go_on.set()
        t.join(30)
    assert out["a"] == {f"c.{OLD_TAG}": total} and sum(counts["a"]) == total and counts["b"] == []
    assert not ns_keys(raw, f"c.{OLD_TAG}") and not raw.exists(gc_lock_key("c"))
    assert not b.run_once().ran  # a pass just ended: the cluster's next one waits for the interval
    assert b.run_once(force=True).ran


def test_a_full_redis_is_collected_and_takes_puts_again(raw, new_gc):
    """Under maxmemory with noeviction a full Redis refuses the live producer's puts; the
    collector still runs there (its writes are allowed over maxmemory) and frees the room."""
    add_lease(raw, "w1", kv_producer=LIVE)
    old = RemoteTier(raw, 1 << 30, f"c.{OLD_TAG}")
    assert old.put_many(items(48, seed=1, size=32 << 10))[0] == 48  # 1.5 MiB of records
    live = RemoteTier(raw, 1 << 30, f"c.{LIVE_TAG}", cooldown_s=0)
    used = int(raw.info("memory")["used_memory"])
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", used - 100_000)  # over it already
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.set("probe", b"x")
    assert live.put_many(items(1, seed=7)) == (0, []) and live.stats()["remote_errors"] == 1
    gc = new_gc(grace_s=0.3)
    until(lambda: gc.run_once(force=True).deleted)
    assert not ns_keys(raw, f"c.{OLD_TAG}")
    until(lambda: live.put_many(items(1, seed=7))[0] == 1)  # UNLINK frees in the background


def test_a_redis_without_script_flags_gets_plain_scripts(raw, new_gc):
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{OLD_TAG}")
    gc = new_gc(grace_s=0.3)
    calls = []

    def refuse(keys, args):  # what Redis 6 answers to a script that starts with a shebang line
        calls.append(keys[0])
        raise redis.ResponseError("Error compiling script (new function): user_script:1: unexpected symbol near '#'")

    gc._writes = {name: (refuse, plain) for name, (_, plain) in gc._writes.items()}
    until(lambda: gc.run_once(force=True).deleted)
    assert calls == [gc_lock_key("c")] and not gc._flagged  # tried once, then plain ones only
    assert not ns_keys(raw, f"c.{OLD_TAG}")


def test_the_lock_is_released_only_by_its_holder(raw, new_gc):
    raw.set(gc_lock_key("c"), b"someone else", px=60_000)
    gc = new_gc(grace_s=0.3)
    assert not gc.run_once(force=True).ran
    assert raw.get(gc_lock_key("c")) == b"someone else"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_redis_never_raises(caplog):
    client = redis.Redis(port=_dead_port(), socket_timeout=0.3, socket_connect_timeout=0.3,
                         retry=Retry(NoBackoff(), 0))
    gc = RemoteGC(client, "c", grace_s=0.3, interval_s=0.05, owns_client=True)
    with caplog.at_level("WARNING", logger="kvmesh.cache_store.remote_gc"):
        for _ in range(3):
            res = gc.run_once(force=True)
            assert not res.ran and "ConnectionError" in res.error
        gc.start()  # the thread keeps trying, and keeps living
        time.sleep(0.5)
        assert gc._thread.is_alive()
        gc.stop()
    assert not gc._thread.is_alive()
    lines = [r for r in caplog.records if "remote tier GC" in r.getMessage()]
    assert len(lines) == 1 and "skipping this pass" in lines[0].getMessage()  # rate-limited


def test_a_silent_redis_and_a_redis_stopped_mid_run_never_raise(redis_server, raw):
    with socket.socket() as s:  # accepts connections but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        client = redis.Redis(port=s.getsockname()[1], socket_timeout=0.3, socket_connect_timeout=0.3,
                             retry=Retry(NoBackoff(), 0))
        res = RemoteGC(client, "c", grace_s=0.3, owns_client=True).run_once(force=True)
        assert not res.ran and "Timeout" in res.error
    add_lease(raw, "w1", kv_producer=LIVE)
    fill(raw, f"c.{OLD_TAG}")
    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.3, socket_connect_timeout=0.3,
                                  retry=Retry(NoBackoff(), 0))
    gc = RemoteGC(client, "c", grace_s=0.3, pause_s=0.0, owns_client=True)
    assert gc.run_once(force=True).ran
    redis_server.stop()
    res = gc.run_once(force=True)
    assert not res.ran and res.error
    gc.stop()


def test_the_worker_runs_it_on_its_own_thread_and_counts_what_it_deleted(redis_server, raw):
    from kvmesh.workers.server import _start_remote_gc

    add_lease(raw, "w1", kv_producer=LIVE)
    own = RemoteTier(connect(redis_server.url), 1 << 30, f"c.{LIVE_TAG}")
    own.put_many(items(2))
    fill(raw, f"c.{OLD_TAG}", n=3, seed=1)
    old = ns_keys(raw, f"c.{OLD_TAG}")
    raw.delete(lease_key("w1", "c"))  # its own lease lapsed for a moment: its namespace is still its own
    engine = SimpleNamespace(tiers=SimpleNamespace(remote=own, config=SimpleNamespace(
        remote_url=redis_server.url, remote_cluster="c")))
    assert _start_remote_gc(engine, 0) is None and _start_remote_gc(SimpleNamespace(tiers=None), 600) is None
    gc = _start_remote_gc(engine, 0.3)
    try:
        assert gc._thread.name == "kvmesh-remote-gc"
        until(lambda: not ns_keys(raw, f"c.{OLD_TAG}"))
        until(lambda: own.stats()["remote_gc_deleted"] == len(old))
        assert len(ns_keys(raw, f"c.{LIVE_TAG}")) > 0
    finally:
        gc.stop()
    assert not gc._thread.is_alive()
    own.client.close()


@pytest.mark.parametrize("value,ok", [("0", 0.0), ("60", 60.0), ("900", 900.0), ("5", None), ("-1", None),
                                      ("nan", None), ("inf", None), ("ten", None)])
def test_the_worker_flag(value, ok, capsys):
    from kvmesh.services.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["worker", "--port", "1"]).remote_gc_grace_s == 600.0
    if ok is not None:
        assert parser.parse_args(["worker", "--port", "1", "--remote-gc-grace-s", value]).remote_gc_grace_s == ok
        return
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--port", "1", "--remote-gc-grace-s", value])
    assert "--remote-gc-grace-s" in capsys.readouterr().err


def test_bad_arguments():
    c = redis.Redis(port=_dead_port())
    for kw in ({"grace_s": 0}, {"grace_s": float("inf")}, {"interval_s": 0}, {"scan_count": 0},
               {"unlink_batch": 0}, {"pause_s": -1}, {"lock_ttl_s": 0}):
        with pytest.raises(ValueError):
            RemoteGC(c, "c", **kw)
    with pytest.raises(ValueError, match="decode_responses"):
        RemoteGC(redis.Redis(port=_dead_port(), decode_responses=True), "c")
