"""The shared remote tier (Redis) as a reuse path, against a cold run.

Engines here are two "workers" of one cluster on a private redis-server: what one puts
in the remote tier, the other loads. A cold run is the same request on an engine with
nothing cached; the same seeded built-in weights make it the reference for every engine.
"""
from __future__ import annotations

import time

import pytest
import redis
import torch

from kvmesh.bench.codec_error import DOCUMENTED_MAX_LOGIT_DIFF
from kvmesh.cache_store.block_record import encode_record
from kvmesh.cache_store.remote_tier import block_key
from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process, wait_healthy
from tests.test_engine_tiers import max_diff, rand_prompt, run
from kvmesh.workers.engine import Engine
from kvmesh.workers.request import SamplingParams

BS = 16
GREEDY = SamplingParams(max_tokens=10)


def cached_blocks(prompt) -> int:
    return (len(prompt) - 1) // BS


def remote_engine(url: str, cluster: str = "t", codec: str = "none", **kw) -> Engine:
    return Engine(num_blocks=64, block_size=BS,
                  tiers=TierConfig(host_bytes=8 << 20, peer_bytes=16 << 20, remote_url=url, remote_bytes=64 << 20,
                                   remote_codec=codec, remote_cluster=cluster, **kw)).start()


def publish(engine: Engine, prompt) -> dict:
    """Run ``prompt`` on ``engine`` and push its blocks down to the remote tier."""
    out, _ = run(engine, prompt)
    engine.offload_device_cache()
    assert engine.tiers.flush(30)
    return out


@pytest.fixture()
def cold_engine():
    e = Engine(num_blocks=64, block_size=BS).start()
    yield e
    e.stop()


def test_remote_hit_on_another_engine_equals_cold(redis_server, cold_engine):
    prompt = rand_prompt(1, 200)
    ref, ref_logits = run(cold_engine, prompt)
    a, b = remote_engine(redis_server.url), remote_engine(redis_server.url)
    try:
        publish(a, prompt)
        assert a.tier_stats()["remote_blocks"] >= cached_blocks(prompt)
        out, logits = run(b, prompt)
        u = out["usage"]
        assert u["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt) == u["cached_tokens"]
        assert out["token_ids"] == ref["token_ids"]
        assert max_diff(logits, ref_logits) < 1e-4
        b.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_local_tiers_first_then_remote_for_the_rest(redis_server, cold_engine):
    """B holds the first 100 tokens on its own host tier; the rest comes from the remote tier."""
    prompt = rand_prompt(2, 220)
    ref, _ = run(cold_engine, prompt)
    a, b = remote_engine(redis_server.url), remote_engine(redis_server.url)
    try:
        publish(a, prompt)
        run(b, prompt[:100])
        b.offload_device_cache()
        out, _ = run(b, prompt)
        by = out["usage"]["cached_tokens_by_tier"]
        assert by["host"] == BS * (99 // BS)
        assert by["host"] + by["remote"] == BS * cached_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
    finally:
        a.stop()
        b.stop()


def test_compressed_remote_hit_within_documented_error(redis_server, cold_engine):
    """A worker whose own remote tier is fp8 loads another's fp8 blocks (within the
    documented error); a worker that keeps exact KV everywhere does not: for it they are a
    miss, and its output is the cold run's exactly."""
    bound = DOCUMENTED_MAX_LOGIT_DIFF["fp8"]
    prompt = rand_prompt(3, 180)
    ref, ref_logits = run(cold_engine, prompt, SamplingParams(max_tokens=1))
    a = remote_engine(redis_server.url, codec="fp8")
    b = remote_engine(redis_server.url, codec="fp8")
    exact = remote_engine(redis_server.url)
    try:
        publish(a, prompt)
        out, logits = run(b, prompt, SamplingParams(max_tokens=1))
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
        assert 0 < max_diff(logits, ref_logits) <= bound
        top = torch.topk(ref_logits[0], 2).values
        if float(top[0] - top[1]) > 2 * bound:
            assert out["token_ids"] == ref["token_ids"]
        out, logits = run(exact, prompt, SamplingParams(max_tokens=1))
        assert out["usage"]["cached_tokens"] == 0 and out["token_ids"] == ref["token_ids"]
        assert max_diff(logits, ref_logits) < 1e-4
        assert a.tier_stats()["remote_blocks"] >= cached_blocks(prompt)  # left in place for workers that accept fp8
    finally:
        a.stop()
        b.stop()
        exact.stop()


def test_damaged_remote_record_is_dropped_and_recomputed(redis_server, cold_engine):
    prompt = rand_prompt(4, 200)
    ref, _ = run(cold_engine, prompt)
    a, b = remote_engine(redis_server.url), remote_engine(redis_server.url)
    try:
        publish(a, prompt)
        from kvmesh.cache_store.hashing import hash_blocks

        hashes = hash_blocks(prompt, BS, b.namespace().root_hash()).hashes
        raw = redis.Redis.from_url(redis_server.url)
        key = block_key(hashes[5], a.tiers.remote.cluster)
        value = bytearray(raw.get(key))
        value[-7] ^= 0x5A  # one payload byte
        raw.set(key, bytes(value))
        out, _ = run(b, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == 5 * BS  # stops before the damaged block
        assert out["token_ids"] == ref["token_ids"]
        assert raw.get(key) is None  # dropped from the cluster's tier
        assert b.tier_stats()["remote_damaged"] == 1
    finally:
        a.stop()
        b.stop()


def test_clusters_do_not_share_and_salt_separates(redis_server, cold_engine):
    prompt = rand_prompt(5, 120)
    a = remote_engine(redis_server.url, cluster="one")
    b = remote_engine(redis_server.url, cluster="two")
    try:
        publish(a, prompt)
        out, _ = run(b, prompt)
        assert out["usage"]["cached_tokens"] == 0
        c = remote_engine(redis_server.url, cluster="one")
        try:
            salted = c.generate(prompt, SamplingParams(max_tokens=2), cache_salt="tenant-b")
            assert salted["usage"]["cached_tokens"] == 0  # same tokens, other namespace: no reuse
        finally:
            c.stop()
    finally:
        a.stop()
        b.stop()


def test_unreachable_redis_is_a_miss_not_a_hang(cold_engine):
    prompt = rand_prompt(6, 160)
    ref, _ = run(cold_engine, prompt)
    e = remote_engine(f"redis://127.0.0.1:{free_port()}/0", remote_timeout_s=0.2)
    # the cool-down after a failure (10 s by default) outlasts this test however slow the
    # machine, so the count of Redis attempts below does not depend on the clock
    e.tiers.remote.cooldown_s = 3600.0
    try:
        out, _ = run(e, prompt)  # prefetch: the read fails at once and opens the cool-down
        e.offload_device_cache()
        assert e.tiers.flush(10)  # the puts, skipped: nothing left queued behind Redis
        out2, _ = run(e, prompt)
        assert out["token_ids"] == out2["token_ids"] == ref["token_ids"]
        assert out2["usage"]["cached_tokens_by_tier"]["host"] == BS * cached_blocks(prompt)
        # a miss, not a hang: one Redis call was made and failed; every later one (the puts,
        # the second prefetch) was a miss at once without trying Redis again
        st = e.tier_stats()
        assert st["remote_errors"] == 1 and st["remote_skipped"] >= 2, st
    finally:
        e.stop()


@pytest.mark.slow
def test_new_worker_process_warms_from_the_cluster(redis_server, tmp_path):
    """Worker A serves a prompt and pushes it down; A stops. Worker B, started afterwards
    with nothing cached, serves the same prompt from the remote tier with A's cold tokens."""
    from tests.test_worker_tiers import generate

    def start(name):
        port = free_port()
        cmd = python_cmd("worker", "--port", str(port), "--worker-id", name, "--threads", "1", "--num-blocks", "160",
                         "--host-bytes", "8M", "--remote-bytes", "64M", "--redis-url", redis_server.url,
                         "--cluster", "warm")
        proc = spawn(cmd, str(tmp_path / f"{name}.log"))
        wait_healthy(f"127.0.0.1:{port}", proc=proc, timeout=120)
        return f"127.0.0.1:{port}", proc

    prompt = rand_prompt(7, 300)
    addr_a, proc_a = start("a")
    try:
        ref = generate(addr_a, prompt)
        assert ref["usage"]["cached_tokens"] == 0
        # a second, longer request pushes the first one's blocks out of the 160-block pool
        for seed in range(3):
            generate(addr_a, rand_prompt(100 + seed, 1000), max_tokens=1)
    finally:
        stop_process(proc_a)  # graceful: queued remote puts are flushed
    addr_b, proc_b = start("b")
    try:
        out = generate(addr_b, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
    finally:
        stop_process(proc_b)


def test_silent_redis_delays_only_the_prefetch_and_never_the_engine(cold_engine):
    """A Redis that accepts connections and never answers: a call ends at the remote
    tier's timeout, as a miss. A request submitted without prefetch (so only the engine
    thread is involved) finishes while a put to the remote tier is stuck."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # keep it open, say nothing
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    put_entered, put_release, put_outwaited = threading.Event(), threading.Event(), []
    e = remote_engine(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", remote_timeout_s=0.3)
    try:
        prompt = rand_prompt(8, 160)
        ref, _ = run(cold_engine, prompt)
        out, _ = run(e, prompt)  # prefetch: one MGET that times out
        assert out["token_ids"] == ref["token_ids"] and out["usage"]["cached_tokens"] == 0
        assert e.tier_stats()["remote_errors"] == 1  # it ended at the timeout, counted, as a miss
        # A put stuck in Redis: the remote writer's next put blocks until this test lets it go
        # (a cool-down would turn a real one into a skip at once). It is let go only after the
        # request below finished, so a request waiting for it could finish only once the put
        # gave up by itself (30 s), which is recorded.
        remote = e.tiers.remote
        real_put = remote.put_many

        def stuck_put(records, tenants=None):
            put_entered.set()
            if not put_release.wait(30):
                put_outwaited.append(len(records))
            return real_put(records, tenants)

        remote.put_many = stuck_put
        e.offload_device_cache()  # queues puts: the first one sticks
        assert put_entered.wait(30), "no put reached the remote tier"
        done = threading.Event()
        got = {}

        def on_output(o):
            got.setdefault("ids", []).extend(o.new_token_ids)
            if o.finished:
                done.set()

        e.submit(rand_prompt(9, 100), GREEDY, on_output)
        assert done.wait(60) and len(got["ids"]) == GREEDY.max_tokens
        assert put_outwaited == [], "the request waited for the stuck put"  # never the engine
        put_release.set()
        assert e.tiers.flush(10)  # every put ended
    finally:
        put_release.set()
        e.stop()
        stop.set()
        srv.close()
        for c in held:
            c.close()


class HangingRedis:
    """A Redis that completes each client's connection handshake and then never answers a
    command (as one SIGSTOPped once its clients are connected): every call waits for the
    client's own timeout. It records the commands each connection sent, connections in the
    order they arrived, so a test counts the calls that reached it (each of which waited).

    ``barrier()`` marks a point in that order: every connection made before it is counted
    from then on, however late a busy machine lets this process read it."""

    HANDSHAKE = {"HELLO", "CLIENT", "SELECT", "AUTH"}

    def __init__(self):
        import socket
        import threading

        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(128)
        self.port = self._srv.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.conns: list[dict] = []  # arrival order: {"cmds": [command names], "eof": bool}
        self._socks: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        self._srv.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                continue
            rec = {"cmds": [], "eof": False}
            with self._lock:
                self.conns.append(rec)
                self._socks.append(conn)
            threading.Thread(target=self._serve, args=(conn, rec), daemon=True).start()

    def _serve(self, conn, rec: dict) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                head = f.readline()
                if not head.startswith(b"*"):
                    return  # closed (or not RESP)
                args = []
                for _ in range(int(head[1:])):
                    size = int(f.readline()[1:])
                    args.append(f.read(size + 2)[:-2])
                name = args[0].decode().upper()
                rec["cmds"].append(name)
                if name == "HELLO":
                    conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                elif name in self.HANDSHAKE:
                    conn.sendall(b"+OK\r\n")
                # anything else: no answer, ever
        except (OSError, ValueError, IndexError):
            return
        finally:
            rec["eof"] = True

    def barrier(self, timeout: float = 30.0) -> int:
        """Index in ``conns`` of a connection made now, once every connection made before it
        was read up to its first real command (or its end). ``timeout`` only against a hang."""
        import socket

        deadline = time.monotonic() + timeout
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"*1\r\n$7\r\nBARRIER\r\n")
            while True:
                with self._lock:
                    conns = list(self.conns)
                mark = next((i for i, c in enumerate(conns) if c["cmds"] == ["BARRIER"]), None)
                if mark is not None and all(c["eof"] or set(c["cmds"]) - self.HANDSHAKE for c in conns[:mark]):
                    c = conns[mark]
                    c["cmds"] = ["BARRIER-DONE"]  # never matched again
                    return mark
                assert time.monotonic() < deadline, "the stand-in Redis did not read its connections"
                time.sleep(0.01)

    def count(self, command: str, start: int, stop: int) -> int:
        """``command``s sent on the connections ``start:stop`` (arrival order)."""
        with self._lock:
            return sum(c["cmds"].count(command) for c in self.conns[start:stop])

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        with self._lock:
            for c in self._socks:
                c.close()


@pytest.mark.slow
def test_worker_with_a_hung_redis_keeps_answering_concurrent_requests(tmp_path):
    """The cluster's Redis accepts connections and never answers (as if SIGSTOPped). Eight
    concurrent requests to a worker using it as its remote tier all finish in about one
    Redis timeout, not one timeout each in a queue; once the tier cools down, in none.

    Counted, not timed: each remote-tier read that reached Redis is one MGET the stand-in
    saw, and each waited for the timeout. The worker's prefetch pool runs at most
    ``PREFETCH_THREADS`` reads at once, and after a timeout the tier tries Redis again only
    once its cool-down is over, which the worker logs ("not trying Redis for"). So the
    reads that waited number at most one per prefetch thread per cool-down opened (all
    waiting together: about one timeout), and a round inside a cool-down makes none."""
    import re
    import threading

    from tests.test_worker_tiers import generate

    prefetch_threads = 4  # kvmesh.workers.server.WorkerServicer's prefetch pool
    hung = HangingRedis()
    port = free_port()
    log = tmp_path / "w.log"
    cmd = python_cmd("worker", "--port", str(port), "--worker-id", "w", "--threads", "1", "--num-blocks", "160",
                     "--host-bytes", "8M", "--remote-bytes", "64M", "--redis-url", hung.url, "--cluster", "hung")
    proc = spawn(cmd, str(log))

    def cooldowns_opened() -> int:  # the worker's own account, one line per cool-down opened
        return len(re.findall(r"remote tier \(hung\.[0-9a-f]{8}\): .*; not trying Redis for", log.read_text(errors="replace")))

    try:
        wait_healthy(f"127.0.0.1:{port}", proc=proc, timeout=120)
        mark, opened = hung.barrier(), cooldowns_opened()
        rounds = []  # (remote-tier reads that reached Redis, cool-downs opened) per round
        for rnd in range(6):
            answered = []

            def one(seed):
                answered.append(len(generate(f"127.0.0.1:{port}", rand_prompt(seed, 120), max_tokens=2)["token_ids"]))

            threads = [threading.Thread(target=one, args=(10 * rnd + i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)  # only against a hang
            assert answered == [2] * 8, answered
            end, now_opened = hung.barrier(), cooldowns_opened()
            reads, opens = hung.count("MGET", mark, end), now_opened - opened
            mark, opened = end, now_opened
            rounds.append((reads, opens))
            # never more waits than one per prefetch thread per cool-down opened
            assert reads <= prefetch_threads * opens, f"reads that waited for Redis, cool-downs opened: {rounds}"
            if rnd == 0:
                assert reads >= 1 and opens >= 1, rounds  # Redis was tried, timed out and cools down
            elif opens == 0:
                break  # a round inside the cool-down: no read reached Redis (asserted above)
            # else: a very slow machine outlasted the cool-down (10 s); the next round is inside one
        assert rounds[-1] == (0, 0), f"no round ran inside a cool-down: {rounds}"
    finally:
        stop_process(proc)
        hung.close()


def test_record_of_the_wrong_payload_size_is_a_miss_and_is_deleted(redis_server, cold_engine):
    """A well-formed record (valid checksums, right chain) whose payload is not this model's
    size: a miss for every worker, deleted from the cluster's tier, never an error."""
    from kvmesh.cache_store.block_record import RecordMeta, checksum, encode_record
    from kvmesh.cache_store.hashing import hash_blocks

    prompt = rand_prompt(31, 100)
    ref, _ = run(cold_engine, prompt)
    e = remote_engine(redis_server.url)
    try:
        hb = hash_blocks(prompt, BS, e.namespace().root_hash())
        payload = bytes(1000)
        meta = RecordMeta(hb.hashes[0], bytes(16), hb.block_tokens(0), "none", e.tiers.dtype_name,
                          e.tiers.block_shape, len(payload), checksum(payload))
        raw = redis.Redis.from_url(redis_server.url)
        key = block_key(hb.hashes[0], e.tiers.remote.cluster)
        raw.set(key, encode_record(meta, payload))
        for _ in range(2):  # the second time the record is gone: a plain miss
            out, _ = run(e, prompt)
            assert out["token_ids"] == ref["token_ids"] and out["usage"]["cached_tokens"] == 0
            e.clear_cache()  # local tiers only; the remote tier is the cluster's
        assert raw.get(key) is None
    finally:
        e.stop()


def test_workers_on_other_hardware_share_no_remote_blocks(redis_server, cold_engine, monkeypatch):
    """Same model and dtypes, other kernels (another instruction set, GPU, torch or attention
    path): their K/V differ in low bits, so a prefix one computed is not what the other's cold
    run gives. The remote tier keeps each producer's records apart; equal producers share."""
    from kvmesh.workers import model_identity

    prompt = rand_prompt(31, 200)
    ref, ref_logits = run(cold_engine, prompt)
    a = remote_engine(redis_server.url, cluster="hw")
    # a worker whose kernels differ (the fault injected: this machine has one kind of CPU)
    real = model_identity.kv_producer
    monkeypatch.setattr(model_identity, "kv_producer", lambda device, attention: real(device, attention) + " (other)")
    other = remote_engine(redis_server.url, cluster="hw")
    monkeypatch.undo()
    same = remote_engine(redis_server.url, cluster="hw")
    try:
        assert other.kv_producer != a.kv_producer == same.kv_producer
        assert other.tiers.remote.cluster != a.tiers.remote.cluster == same.tiers.remote.cluster
        assert a.tiers.remote.cluster.startswith("hw.")
        publish(a, prompt)
        out, _ = run(other, prompt)
        assert out["usage"]["cached_tokens"] == 0 and out["token_ids"] == ref["token_ids"]
        out, logits = run(same, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"] and max_diff(logits, ref_logits) < 1e-4
    finally:
        for e in (a, other, same):
            e.stop()


def test_forged_remote_records_are_never_loaded_with_a_record_key(redis_server, cold_engine):
    """An attacker who can write to Redis but lacks the cluster's record key rewrites every
    record with zeroed KV and correct checksums, and plants a forged record for a block
    nobody has computed yet; the reading engine loads none of them and answers as cold."""
    from kvmesh.cache_store.block_record import checksum, decode_record
    from kvmesh.cache_store.hashing import hash_blocks
    from kvmesh.cache_store.remote_tier import TAG_BYTES

    key = bytes(range(32))
    prompt, later = rand_prompt(11, 200), rand_prompt(12, 200)
    ref, _ = run(cold_engine, prompt)
    ref_later, _ = run(cold_engine, later)
    a, b = remote_engine(redis_server.url, remote_record_key=key), remote_engine(redis_server.url,
                                                                                 remote_record_key=key)
    try:
        publish(a, prompt)
        raw = redis.Redis.from_url(redis_server.url)
        cluster = a.tiers.remote.cluster
        forged_keys = list(raw.scan_iter(f"kvmesh:{cluster}:kv:*"))
        assert len(forged_keys) >= cached_blocks(prompt)
        sample = None
        for k in forged_keys:
            value = raw.get(k)
            meta, payload = decode_record(value[:-TAG_BYTES])
            zeros = bytes(len(payload))
            sample = (meta, len(payload))
            raw.set(k, encode_record(meta._replace(payload_checksum=checksum(zeros)), zeros) + value[-TAG_BYTES:])
        # planted before anyone computes `later`: block hashes are public functions of the prompt
        h0 = hash_blocks(later, BS, b.namespace().root_hash()).hashes[0]
        meta, n = sample
        zeros = bytes(n)
        planted = meta._replace(block_hash=h0, parent_hash=bytes(16), token_bytes=b"".join(
            int(x).to_bytes(4, "little") for x in later[:BS]), payload_checksum=checksum(zeros))
        raw.set(block_key(h0, cluster), encode_record(planted, zeros) + bytes(TAG_BYTES))
        out, _ = run(b, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == 0
        assert out["token_ids"] == ref["token_ids"]
        out_later, _ = run(b, later)
        assert out_later["usage"]["cached_tokens_by_tier"]["remote"] == 0
        assert out_later["token_ids"] == ref_later["token_ids"]
        assert b.tier_stats()["remote_damaged"] >= 2
    finally:
        a.stop()
        b.stop()


def test_workers_with_another_record_key_neither_read_nor_delete_the_records(redis_server, cold_engine):
    """A key rotation or a rolling upgrade: each key's records keep to their own namespace."""
    prompt = rand_prompt(13, 200)
    ref, _ = run(cold_engine, prompt)
    a = remote_engine(redis_server.url, remote_record_key=bytes(range(32)))
    others = [remote_engine(redis_server.url, remote_record_key=bytes(range(1, 33))), remote_engine(redis_server.url)]
    try:
        publish(a, prompt)
        raw = redis.Redis.from_url(redis_server.url)
        stored = set(raw.scan_iter(f"kvmesh:{a.tiers.remote.cluster}:kv:*"))
        assert len(stored) >= cached_blocks(prompt)
        for e in others:
            assert e.tiers.remote.cluster != a.tiers.remote.cluster
            out, _ = run(e, prompt)
            assert out["usage"]["cached_tokens_by_tier"]["remote"] == 0 and out["token_ids"] == ref["token_ids"]
            assert e.tier_stats()["remote_damaged"] == 0
        assert set(raw.scan_iter(f"kvmesh:{a.tiers.remote.cluster}:kv:*")) >= stored  # nothing deleted
        b = remote_engine(redis_server.url, remote_record_key=bytes(range(32)))  # the same key: shared
        try:
            out, _ = run(b, prompt)
            assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
            assert out["token_ids"] == ref["token_ids"]
        finally:
            b.stop()
    finally:
        a.stop()
        for e in others:
            e.stop()


def test_remote_slower_than_prefill_is_not_fetched_under_the_cost_policy(redis_server, cold_engine):
    """Under ``load_policy="cost"`` a remote tier measured slower per block than this
    worker's prefill (a GPU prefills a small model faster than a Redis round trip returns
    its KV) is not read at all: the request computes its prefix, outputs equal cold, and the
    cut is counted; every PROBE_EVERY-th cut reads anyway and measures the tier again."""
    a, b = remote_engine(redis_server.url), remote_engine(redis_server.url, load_policy="cost")
    try:
        warm = rand_prompt(2, 200)
        publish(a, warm)
        out, _ = run(b, warm)  # measures the remote tier (and b's prefill)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(warm)
        measured = b.tiers.load_seconds_per_block["remote"]
        assert measured > 0

        prompt = rand_prompt(3, 200)
        ref, ref_logits = run(cold_engine, prompt)
        publish(a, prompt)
        slow = 10.0  # injected: a remote tier that took 10 s per block
        b.tiers.load_seconds_per_block["remote"] = slow
        b._prefill_rate = b._prefill_rate or 1000.0
        gets = redis.Redis.from_url(redis_server.url).info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        out, logits = run(b, prompt)
        assert out["usage"]["cached_tokens"] == 0
        assert out["token_ids"] == ref["token_ids"] and max_diff(logits, ref_logits) < 1e-4
        assert b.tier_stats()["fetches_not_worth_it"] == 1
        assert redis.Redis.from_url(redis_server.url).info("commandstats").get(
            "cmdstat_mget", {}).get("calls", 0) == gets  # nothing was asked of Redis

        b.clear_cache()
        b.tiers._cuts[("fetch", "remote")] = b.tiers.PROBE_EVERY - 1  # the next cut is a probe
        out, logits = run(b, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["remote"] == BS * cached_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
        assert b.tiers.load_seconds_per_block["remote"] < slow  # measured again
    finally:
        a.stop()
        b.stop()


def test_a_prefetch_after_a_peer_fetch_keeps_the_peer_blocks_staged(redis_server, cold_engine):
    """A worker stages a prefix fetched from a peer, then its own prefetch stages what follows
    from the remote tier. With a staging area smaller than both runs, the prefetch must stage
    only what fits beside the peer blocks: staging past that evicted the request's own
    leading blocks, and nothing at all was reused."""
    from kvmesh.cache_store.hashing import hash_blocks
    from kvmesh.workers.peer_fetch import _verify
    from tests.test_engine_tiers import BLOCK_BYTES
    from tests.test_peer_fetch import as_msgs

    prompt = rand_prompt(77, 20 * BS + 5)
    publisher = remote_engine(redis_server.url, cluster="staging")
    try:
        publish(publisher, prompt)  # the whole prompt in the remote tier
    finally:
        publisher.stop()
    holder = Engine(num_blocks=64, block_size=BS).start()
    fetcher = Engine(num_blocks=64, block_size=BS,
                     tiers=TierConfig(host_bytes=8 << 20, peer_bytes=12 * BLOCK_BYTES, remote_url=redis_server.url,
                                      remote_bytes=64 << 20, remote_cluster="staging", load_policy="always")).start()
    try:
        run(holder, prompt[:10 * BS + 1])  # the peer holds the first 10 blocks
        ns = fetcher.namespace()
        chain = hash_blocks(prompt, BS, ns.root_hash())
        records = holder.export_blocks(chain.hashes[:10])
        staged = fetcher.tiers.stage([_verify(m, i, chain, ns.root_hash(), fetcher)
                                      for i, m in enumerate(as_msgs(records))])
        assert staged == 10 and fetcher.tiers.peer.num_slots == 12
        assert fetcher.prefetch(prompt) == {"remote": 2}  # what fits beside the 10 peer blocks
        out, _ = run(fetcher, prompt)
        by_tier = out["usage"]["cached_tokens_by_tier"]
        assert by_tier["peer"] == 10 * BS, by_tier
        assert out["usage"]["cached_tokens"] >= 12 * BS, out["usage"]  # the rest loads in scheduling or computes
        cold, _ = run(cold_engine, prompt)
        assert out["token_ids"] == cold["token_ids"]
    finally:
        holder.stop()
        fetcher.stop()
