"""Tenant isolation on every tier below the device pool: host, disk (after a restart) and
the cluster's remote tier in Redis. Tenant B sending tenant A's prompt with A's cache salt
must reuse nothing; A itself reuses from the tier, with output equal to B's cold run.
Also the namespace root: a tenant is not a salt (no salt of one tenant reaches another)."""
from __future__ import annotations

import random
import threading
import time

from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.request import SamplingParams

BS = 16
GREEDY = SamplingParams(max_tokens=6)
SALT = "a-secret"


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def check_isolated(reader: Engine, ids: list[int], medium: str, a_tokens: list[int]) -> None:
    b = reader.generate(ids, GREEDY, cache_salt=SALT, tenant="tenant-b")
    assert b["usage"]["cached_tokens"] == 0
    a = reader.generate(ids, GREEDY, cache_salt=SALT, tenant="tenant-a")
    assert a["usage"]["cached_tokens_by_tier"][medium] == BS * ((len(ids) - 1) // BS)
    assert a["token_ids"] == b["token_ids"] == a_tokens
    reader.check_integrity()


def test_namespace_tenant_is_not_a_salt():
    roots = {Namespace("m", cache_salt="x").root_hash(), Namespace("m", tenant="x").root_hash(),
             Namespace("m", cache_salt="x", tenant="x").root_hash(), Namespace("m").root_hash(),
             Namespace("m", cache_salt="", tenant="a").root_hash(), Namespace("m", cache_salt="a").root_hash()}
    assert len(roots) == 6
    assert Namespace("m", tenant="").root_hash() == Namespace("m").root_hash()  # open mode: hashes unchanged


def test_host_tier_and_snapshot_keep_tenants_apart():
    ids = prompt(1, 7 * BS + 3)
    e = Engine(num_blocks=64, block_size=BS, tiers=TierConfig(host_bytes=16 << 20, peer_bytes=0)).start()
    try:
        a = e.generate(ids, GREEDY, cache_salt=SALT, tenant="tenant-a")
        e.offload_device_cache()
        assert e.tiers.flush(30)
        held = {h for h, _, _ in e.snapshot()["blocks"]}
        mine = hash_blocks(ids, BS, e.namespace(SALT, "", "tenant-a").root_hash()).hashes
        theirs = hash_blocks(ids, BS, e.namespace(SALT, "", "tenant-b").root_hash()).hashes
        assert set(mine) <= held and not set(theirs) & held
        check_isolated(e, ids, "host", a["token_ids"])
    finally:
        e.stop()


def test_disk_tier_keeps_tenants_apart_across_a_restart(tmp_path):
    ids = prompt(2, 6 * BS + 1)
    cfg = TierConfig(host_bytes=16 << 20, disk_dir=str(tmp_path), disk_bytes=64 << 20, peer_bytes=0)
    e = Engine(num_blocks=64, block_size=BS, tiers=cfg).start()
    try:
        a = e.generate(ids, GREEDY, cache_salt=SALT, tenant="tenant-a")
        e.offload_device_cache()
        assert e.tiers.flush(30)
    finally:
        e.stop()
    e = Engine(num_blocks=64, block_size=BS, tiers=cfg).start()  # host tier empty, disk re-indexed
    try:
        check_isolated(e, ids, "disk", a["token_ids"])
    finally:
        e.stop()


def test_remote_tier_keeps_tenants_apart(redis_server):
    ids = prompt(3, 5 * BS + 4)
    cfg = TierConfig(host_bytes=8 << 20, peer_bytes=16 << 20, remote_url=redis_server.url, remote_bytes=64 << 20,
                     remote_cluster="tenants")
    writer, reader = Engine(num_blocks=64, block_size=BS, tiers=cfg).start(), None
    try:
        a = writer.generate(ids, GREEDY, cache_salt=SALT, tenant="tenant-a")
        writer.offload_device_cache()
        assert writer.tiers.flush(30)
        reader = Engine(num_blocks=64, block_size=BS, tiers=cfg).start()
        check_isolated(reader, ids, "remote", a["token_ids"])
    finally:
        writer.stop()
        if reader is not None:
            reader.stop()


def test_a_tenant_flooding_the_device_pool_evicts_its_own_blocks_first():
    """Tenant A caches a 6-block prompt; tenant B then sends 20 distinct 6-block prompts
    through a 32-block pool (far more than fits). Eviction is fair between tenants (the one
    holding most loses first), so A's blocks survive B's flood: A's prompt is a full device
    hit afterwards, and its output equals a cold run's."""
    ids = prompt(7, 6 * BS + 1)
    cold = Engine(num_blocks=32, block_size=BS).start()
    e = Engine(num_blocks=32, block_size=BS).start()
    try:
        ref = cold.generate(ids, GREEDY, tenant="tenant-a")
        e.generate(ids, GREEDY, tenant="tenant-a")
        for i in range(20):
            e.generate(prompt(100 + i, 6 * BS + 1), GREEDY, tenant="tenant-b")
        held = e.cache.pool.blocks_by_owner()
        assert held["tenant-a"] == 6 and held["tenant-b"] > 6, held
        again = e.generate(ids, GREEDY, tenant="tenant-a")
        assert again["usage"]["cached_tokens_by_tier"]["device"] == 6 * BS, again["usage"]
        assert again["token_ids"] == ref["token_ids"]
        e.check_integrity()
        # the same flood from tenant A itself is plain LRU: its old prompt goes
        for i in range(20):
            e.generate(prompt(200 + i, 6 * BS + 1), GREEDY, tenant="tenant-a")
        assert e.generate(ids, GREEDY, tenant="tenant-a")["usage"]["cached_tokens"] == 0
    finally:
        e.stop()
        cold.stop()


def test_a_flood_does_not_push_another_tenants_blocks_out_of_the_host_tier():
    """Tenant A's prompt is moved down to the host tier (room for 16 blocks); tenant B then
    sends 20 distinct prompts, whose evicted blocks stream into the host tier. Host eviction
    is fair between tenants too: A's blocks stay, its prompt is a full hit from the tiers,
    equal to a cold run."""
    ids = prompt(8, 6 * BS + 1)
    cold = Engine(num_blocks=32, block_size=BS).start()
    probe = Engine(num_blocks=32, block_size=BS, tiers=TierConfig(host_bytes=1 << 20, peer_bytes=0))
    block_bytes = probe.tiers.codec("none").payload_bytes
    e = Engine(num_blocks=32, block_size=BS, tiers=TierConfig(host_bytes=16 * block_bytes, peer_bytes=0)).start()
    try:
        ref = cold.generate(ids, GREEDY, tenant="tenant-a")
        e.generate(ids, GREEDY, tenant="tenant-a")
        e.offload_device_cache()
        assert e.tiers.flush(30)
        for i in range(20):
            e.generate(prompt(300 + i, 6 * BS + 1), GREEDY, tenant="tenant-b")
        assert e.tiers.flush(30)
        assert e.tiers.host.entries_by_tenant().get("tenant-a") == 6, e.tiers.host.entries_by_tenant()
        again = e.generate(ids, GREEDY, tenant="tenant-a")
        assert again["usage"]["cached_tokens"] == 6 * BS, again["usage"]
        assert again["token_ids"] == ref["token_ids"]
        e.check_integrity()
    finally:
        e.stop()
        cold.stop()


def test_the_remote_tier_records_each_blocks_tenant_for_fair_eviction(redis_server):
    """Blocks a worker puts in the cluster's remote tier carry the tenant whose request
    cached them (its eviction is fair between tenants: tests/test_remote_tier.py), and the
    tier's byte count per tenant adds up."""
    import redis as redis_lib

    from kvmesh.cache_store.remote_tier import owners_key, tenant_bytes_key

    cfg = TierConfig(host_bytes=16 << 20, peer_bytes=16 << 20, remote_url=redis_server.url, remote_bytes=64 << 20,
                     remote_cluster="tt")
    e = Engine(num_blocks=64, block_size=BS, tiers=cfg).start()
    r = redis_lib.Redis.from_url(redis_server.url)
    try:
        for tenant, seed in (("tenant-a", 11), ("tenant-b", 12)):
            e.generate(prompt(seed, 4 * BS + 1), GREEDY, cache_salt=SALT, tenant=tenant)
        e.offload_device_cache()
        assert e.tiers.flush(30)
        ns = e.tiers.remote.cluster  # "tt.<producer tag>"
        owners = {v.decode() for v in r.hgetall(owners_key(ns)).values()}
        per_tenant = {k.decode(): int(v) for k, v in r.hgetall(tenant_bytes_key(ns)).items()}
        assert owners == {"tenant-a", "tenant-b"} and set(per_tenant) == {"tenant-a", "tenant-b"}
        assert sum(per_tenant.values()) == int(r.get(f"kvmesh:{ns}:kv-bytes"))
    finally:
        r.close()
        e.stop()


def test_a_tenant_whose_requests_fill_the_pool_still_evicts_only_its_own_blocks():
    """Tenant B's prompts each need 57 of the pool's 64 blocks; tenant A holds 4. A running
    request's blocks count as its tenant's, so B (57 in use) is always the larger holder and
    its new requests evict B's earlier blocks, never A's: A's prompt stays a full device hit
    after B's tenth prompt, equal to a cold run."""
    ids = prompt(9, 4 * BS + 6)
    sampling = SamplingParams(max_tokens=2)
    cold = Engine(num_blocks=64, block_size=BS).start()
    e = Engine(num_blocks=64, block_size=BS).start()
    try:
        ref = cold.generate(ids, sampling, tenant="tenant-a")
        e.generate(ids, sampling, tenant="tenant-a")
        for i in range(10):
            e.generate(prompt(400 + i, 900), sampling, tenant="tenant-b")
        again = e.generate(ids, sampling, tenant="tenant-a")
        assert again["usage"]["cached_tokens_by_tier"]["device"] == 4 * BS, again["usage"]
        assert again["token_ids"] == ref["token_ids"]
        e.check_integrity()
    finally:
        e.stop()
        cold.stop()


def _flood_while_running(idle_s: float) -> tuple[dict, list[dict], list[list[int]]]:
    """Tenant B caches a 20-block prompt on a 64-block pool; tenant A then sends four
    31-block prompts at once (each fits alone; together nearly twice the pool). Returns B's
    prompt sent again afterwards, A's results followed by the number of requests held back
    for B's share, and A's prompts."""
    b_ids = prompt(9, 20 * BS + 1)
    a_ids = [prompt(400 + i, 30 * BS + 1) for i in range(4)]
    e = Engine(num_blocks=64, block_size=BS).start()
    e.scheduler.tenant_idle_s = idle_s
    try:
        e.generate(b_ids, GREEDY, tenant="tenant-b")
        results: list = [None] * len(a_ids)

        def send(i: int) -> None:
            results[i] = e.generate(a_ids[i], GREEDY, tenant="tenant-a")

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(a_ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None for r in results), "a request of tenant A did not finish"
        e.check_integrity()
        results.append(e.scheduler.num_held_for_fairness)
        return e.generate(b_ids, GREEDY, tenant="tenant-b"), results, a_ids
    finally:
        e.stop()


def test_another_tenants_running_requests_leave_an_active_tenant_its_share():
    """Blocks held by running requests cannot be evicted, so without the protected share
    tenant A's concurrent prompts took B's cached blocks once A's own were in use. With B
    active (its last request within ``tenant_idle_s``) and under an equal split (20 of 64
    blocks), A's later prompts wait for A's earlier ones to end and reuse their blocks:
    B's prompt is still a full device hit, and A's outputs equal cold runs."""
    again, results, a_ids = _flood_while_running(idle_s=600)
    assert again["usage"]["cached_tokens_by_tier"].get("device") == 20 * BS, again["usage"]
    held = results.pop()
    assert 1 <= held <= 3, held  # A's later prompts waited, each counted once
    cold = Engine(num_blocks=64, block_size=BS).start()
    try:
        for ids, r in zip(a_ids, results):
            assert r["token_ids"] == cold.generate(ids, GREEDY, tenant="tenant-a")["token_ids"]
    finally:
        cold.stop()


def test_an_idle_tenants_blocks_are_not_protected():
    """The same flood with B idle (``tenant_idle_s`` 0: active only while it has a request
    on the worker): B's blocks are evicted first, so a busy tenant is not held to a share
    of the pool by tenants that stopped sending."""
    again, results, _ = _flood_while_running(idle_s=0)
    assert again["usage"]["cached_tokens"] < 20 * BS, again["usage"]
    assert results.pop() == 0
    assert all(r["finish_reason"] for r in results)


class Stepped:
    """An engine stepped by hand (deterministic): ``send`` queues a request, ``until`` steps."""

    def __init__(self, **kw):
        self.e = Engine(block_size=BS, **kw)
        self.done: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def send(self, name: str, ids: list[int], max_tokens: int, tenant: str) -> None:
        self.tokens[name] = []

        def on_output(o):
            self.tokens[name].extend(o.new_token_ids)
            if o.finished:
                self.done[name] = self.tokens[name]

        self.e.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_output, tenant=tenant)

    def until(self, cond, steps: int = 3000, each=None) -> int:
        for i in range(steps):
            if cond():
                return i
            self.e.step()
            if each is not None:
                each()
        raise AssertionError(f"not within {steps} steps")

    def held(self, tenant: str) -> int:
        return self.e.cache.pool.blocks_by_owner().get(tenant, 0)

    def cache_b_then_run_a(self, name: str, ids: list[int], max_tokens: int) -> None:
        """Tenant B caches a 30-block prompt and stays active; tenant A then runs ``name``."""
        self.send("b", prompt(1, 30 * BS + 1), 1, "B")
        self.until(lambda: "b" in self.done)
        self.send(name, ids, max_tokens, "A")
        self.e.step()


def test_two_tenants_second_requests_do_not_share_the_same_free_blocks():
    """B caches 30 of 96 blocks (under its split of 32 among three active tenants). A and C
    each run a one-block request, then each sends a 56-block prompt. Each alone fits in the
    free blocks, but not both: counted for each tenant alone, both started and B fell to 11
    blocks. Every running prompt's remaining blocks count now, so C's waits while A's runs
    and B keeps its 30. (C's then starts once C's own small request ends, as its first
    running request, and may take B's blocks: the documented one-request allowance.)"""
    s = Stepped(num_blocks=96, max_num_batched_tokens=64)
    s.send("b", prompt(1, 30 * BS + 1), 1, "B")
    s.until(lambda: "b" in s.done)
    s.send("a1", prompt(2, 17), 400, "A")
    s.send("c1", prompt(3, 17), 400, "C")
    s.e.step()
    s.e.step()
    s.send("a2", prompt(4, 55 * BS + 1), 1, "A")
    s.send("c2", prompt(5, 55 * BS + 1), 1, "C")
    low = [s.held("B")]
    s.until(lambda: "a2" in s.done or "c2" in s.done, each=lambda: low.append(s.held("B")))
    assert min(low) == 30, min(low)
    assert s.e.scheduler.num_held_for_fairness >= 1
    s.until(lambda: "a2" in s.done and "c2" in s.done)
    s.e.check_integrity()


def test_a_held_request_is_not_overtaken_by_its_tenants_later_ones():
    """A keeps three small requests in flight and sends a 33-block prompt that fits A's room
    alone but not beside them: it waited for one of A's own to end, and A's later small
    requests kept starting meanwhile, so it waited forever (200 of them finished after it
    in a run of 1,500 steps). A's later requests now wait behind it."""
    s = Stepped(num_blocks=64)
    s.cache_b_then_run_a("s0", prompt(100, 17), 20)
    s.send("big", prompt(2, 33 * BS), 1, "A")
    sent = iter(range(1, 10**6))

    def top_up():
        live = [n for n in s.tokens if n.startswith("s") and n not in s.done]
        for _ in range(3 - len(live)):
            k = next(sent)
            s.send(f"s{k}", prompt(100 + k, 17), 20 + k % 7, "A")

    s.until(lambda: "big" in s.done, steps=400, each=top_up)
    assert s.e.scheduler.num_held_for_fairness >= 1
    ref = Engine(num_blocks=64, block_size=BS).start()
    try:
        cold = ref.generate(prompt(2, 33 * BS), SamplingParams(max_tokens=1, ignore_eos=True), tenant="A")
    finally:
        ref.stop()
    assert s.done["big"] == cold["token_ids"]


def test_a_long_request_does_not_keep_idle_tenants_active():
    """``tenant_idle_s`` 0: only tenants with a request on the worker are active. A long
    request of X, older than C's, stopped the pruning of tenants seen after it, so C (done,
    30 cached blocks) stayed protected and A's second prompt was held for it."""
    s = Stepped(num_blocks=64)
    s.e.scheduler.tenant_idle_s = 0
    s.send("x", prompt(1, 17), 300, "X")
    s.e.step()
    s.send("c", prompt(2, 30 * BS + 1), 1, "C")
    s.until(lambda: "c" in s.done)
    s.send("a1", prompt(3, 17), 200, "A")
    s.e.step()
    s.send("a2", prompt(4, 45 * BS), 1, "A")
    s.until(lambda: "a2" in s.done, steps=200)
    assert s.e.scheduler.num_held_for_fairness == 0
    assert s.held("C") < 30  # idle: its cached blocks went first


def test_a_request_behind_a_held_one_is_still_shed_at_its_deadline():
    """A's later requests wait behind A's held one; one whose deadline passed meanwhile was
    kept queued (and counted as load) until A's running request ended. It is shed as soon
    as it is considered past its deadline, held tenant or not."""
    s = Stepped(num_blocks=64)
    s.cache_b_then_run_a("a1", prompt(3, 17), 150)
    s.send("a2", prompt(4, 40 * BS), 1, "A")
    s.e.step()
    assert s.e.scheduler.num_held_for_fairness == 1
    out = {}
    s.e.submit(prompt(5, 17), SamplingParams(max_tokens=1), lambda o: o.finished and out.update(code=o.error_code),
               tenant="A", deadline=time.monotonic() + 0.05)
    time.sleep(0.1)
    s.until(lambda: out, steps=3)
    assert out["code"] == "DEADLINE_EXCEEDED" and "a1" not in s.done
