"""End-to-end: real redis-server, router and worker processes on loopback.

Covers: hits through the router equal cold runs; a SIGKILLed worker leaves the index
within its lease and nothing hangs; a restarted router rebuilds its index from Redis and
the workers; bad input through the router keeps its status code.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import redis

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cli import generate
from kvmesh.services.launcher import ClusterSpec, LocalCluster
from kvmesh.workers.kv_publisher import lease_key

pytestmark = pytest.mark.slow
BS = 16
LEASE_TTL_S = 3.0  # workers.kv_publisher.WorkerLease default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(num_workers=2, num_blocks=512, threads_per_worker=1,
                       log_dir=str(tmp_path_factory.mktemp("logs")))
    with LocalCluster(spec) as c:
        yield c


def status(address: str) -> pb.RouterStatus:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)


def clear_worker(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        pb_grpc.WorkerStub(ch).ClearCache(pb.ClearCacheRequest(), timeout=10)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def router_polls(rc: redis.Redis) -> int:
    """Registry polls of the router's index subscriber so far, as Redis counted them."""
    return int(rc.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_router_hit_equals_cold(cluster):
    prompt = toks(1, 150)
    first = generate(cluster.router_address, token_ids=prompt, max_tokens=10)
    assert first["usage"]["cached_tokens"] == 0
    # the index learns the worker's blocks from its KV events
    wait_for(lambda: status(cluster.router_address).indexed_blocks >= len(prompt) // BS, 10, "KV events")
    second = generate(cluster.router_address, token_ids=prompt + toks(2, 20), max_tokens=10)
    assert second["worker_id"] == first["worker_id"]
    assert second["usage"]["cached_tokens"] == BS * (len(prompt) // BS)
    # cold reference: the same request on the same worker after clearing its cache
    address = cluster.workers[second["worker_id"]][0]
    clear_worker(address)
    cold = generate(address, token_ids=prompt + toks(2, 20), max_tokens=10)
    assert cold["usage"]["cached_tokens"] == 0
    assert second["token_ids"] == cold["token_ids"]


def test_conversation_follows_its_worker(cluster):
    turn1 = toks(10, 100)
    r1 = generate(cluster.router_address, token_ids=turn1, max_tokens=8)
    wait_for(lambda: status(cluster.router_address).indexed_blocks > 0, 10, "KV events")
    turn2 = turn1 + r1["token_ids"] + toks(11, 30)
    r2 = generate(cluster.router_address, token_ids=turn2, max_tokens=8)
    assert r2["worker_id"] == r1["worker_id"]
    assert r2["usage"]["cached_tokens"] >= BS * (len(turn1) // BS)
    address = cluster.workers[r2["worker_id"]][0]
    clear_worker(address)
    assert generate(address, token_ids=turn2, max_tokens=8)["token_ids"] == r2["token_ids"]


def test_bad_input_through_router(cluster):
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.router_address, token_ids=[1, 2, 999], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.router_address, prompt="", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_router_restart_rebuilds_index(cluster):
    prompt = toks(20, 120)
    first = generate(cluster.router_address, token_ids=prompt, max_tokens=4)
    wait_for(lambda: status(cluster.router_address).indexed_blocks > 0, 10, "KV events")
    cluster.restart_router()
    cluster.wait_registered()
    wait_for(lambda: status(cluster.router_address).indexed_blocks >= len(prompt) // BS, 15,
             "the restarted router to rebuild its index")
    again = generate(cluster.router_address, token_ids=prompt + toks(21, 10), max_tokens=4)
    assert again["worker_id"] == first["worker_id"]
    assert again["usage"]["cached_tokens"] == BS * (len(prompt) // BS)


def test_sigkill_worker_mid_run(cluster):
    """Runs last in this module: it kills a worker."""
    target = cluster.router_address
    prompt = toks(30, 64)
    first = generate(target, token_ids=prompt, max_tokens=2)
    victim = first["worker_id"]
    wait_for(lambda: any(w.worker_id == victim and w.cached_blocks > 0 for w in status(target).workers), 10,
             "the victim's blocks in the index")
    outcome: dict = {}
    streaming = threading.Event()

    def long_request():
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True))
        req.token_ids.ids.extend(prompt + toks(31, 8))
        try:
            with grpc.insecure_channel(target) as ch:
                for msg in pb_grpc.WorkerStub(ch).Generate(req, timeout=60):
                    outcome["worker_id"] = msg.worker_id
                    streaming.set()
            outcome["result"] = True
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
        finally:
            streaming.set()

    t = threading.Thread(target=long_request)
    t.start()
    # kill only once tokens flow: on a busy machine a fixed sleep could kill the victim before
    # the router forwarded the request, which then retries the 2000-token run elsewhere
    assert streaming.wait(30), "the long request never started streaming"
    assert outcome.get("worker_id") == victim, outcome  # same prefix: routed to its holder
    cluster.kill_worker(victim)  # returns once the process is gone: no heartbeat after this
    rc = redis.Redis.from_url(cluster.redis_url)
    lease = lease_key(victim, cluster.cluster)
    # the lease lapses within its TTL: its last heartbeat set it to expire at most that much
    # later (Redis's clock; -2: already gone)
    left_ms = rc.pttl(lease)
    assert left_ms == -2 or 0 < left_ms <= LEASE_TTL_S * 1000, left_ms
    t.join(30)
    assert not t.is_alive(), "in-flight request hung after its worker was killed"
    assert "result" in outcome or outcome.get("code") == grpc.StatusCode.UNAVAILABLE
    if "code" in outcome:  # says what happened, not only gRPC's "Stream removed (Socket closed)"
        assert f"worker {victim} went away during the answer" in outcome["details"] and "retry" in outcome["details"]
    # entries leave the index within the lease (+ one poll of the subscriber): counted in
    # the router's registry polls (each one SMEMBERS, which only the router's subscriber
    # sends; Redis counts them), not in seconds a busy machine could stretch
    wait_for(lambda: not rc.exists(lease), 60, "the killed worker's lease to lapse")  # only against a hang
    expired_at = router_polls(rc)
    # a poll that starts after the expiry no longer lists the victim; the one under way may
    # have read the lease just before. Once a second poll has started, the first is done.
    wait_for(lambda: all(w.worker_id != victim for w in status(target).workers)
                    or router_polls(rc) >= expired_at + 2, 60, "the router's next polls")
    assert all(w.worker_id != victim for w in status(target).workers), \
        f"the killed worker is still routed to {router_polls(rc) - expired_at} polls after its lease lapsed"
    rc.close()
    # later requests, even with the victim's prefix, go to survivors and succeed
    for i in range(3):
        out = generate(target, token_ids=prompt + toks(40 + i, 8), max_tokens=2, timeout=30)
        assert out["worker_id"] != victim
