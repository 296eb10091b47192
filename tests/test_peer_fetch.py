"""Peer fetch without processes: the fetch decision, the transfer model, the router's choice
of holder, and blocks exported by one engine, verified and staged into another, used as a
``peer`` hit equal to a cold run."""
from __future__ import annotations

import math
import random

import pytest

from kvmesh.cache_store.block_record import RecordError
from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.services.policies import WorkerView
from kvmesh.services.router import prefix_holder
from kvmesh.workers.engine import Engine
from kvmesh.workers.peer_fetch import TransferModel, _verify, decide
from kvmesh.workers.request import SamplingParams

BS = 16


def model(latency=None, bw=None, now=None) -> TransferModel:
    m = TransferModel()
    if latency is not None:
        m.observe(latency, int(bw * 1.0), 1.0, now=now)
    return m


def test_transfer_model_estimates_and_failures():
    m = model(0.01, 1e8, now=100.0)
    assert m.estimate(10**8, now=100.0) == pytest.approx(1.01)
    m.observe(0.03, 2 * 10**8, 1.0, now=101.0)  # EWMA towards the new sample
    assert 0.01 < m.latency_s < 0.03 and 1e8 < m.bytes_per_s < 2e8
    assert m.estimate(1, now=200.0) is None  # history expired: probe again
    m.observe(None, 0, 0.0, failed_after_s=0.5, now=300.0)
    assert m.estimate(1, now=301.0) == math.inf  # a peer that gave nothing is not asked again...
    assert m.estimate(1, now=331.0) is None  # ...until its history expires
    assert TransferModel().estimate(1) is None


def test_decide():
    rate = 10_000.0  # tokens/s -> 1,024 tokens take 0.1024 s to recompute
    fast, slow = model(0.001, 1e9), model(0.05, 1e7)
    nbytes = 64 * 65536
    d = decide("auto", nbytes, 1024, rate, fast, 2.0, None)
    assert d.fetch and d.reason == "transfer faster" and d.deadline_s == pytest.approx(0.1024)
    d = decide("auto", nbytes, 1024, rate, slow, 2.0, None)
    assert not d.fetch and d.est_transfer_s > d.est_recompute_s
    d = decide("auto", nbytes, 1024, rate, TransferModel(), 2.0, None)
    assert d.fetch and d.reason == "probe" and d.deadline_s == pytest.approx(0.1024)
    d = decide("auto", nbytes, 1024, rate, fast, 2.0, 0.05)  # the request's own deadline caps it
    assert d.deadline_s == pytest.approx(0.05)
    assert decide("always", nbytes, 1024, rate, slow, 0.7, None).deadline_s == pytest.approx(0.7)
    assert not decide("never", nbytes, 1024, rate, fast, 2.0, None).fetch
    assert not decide("auto", 0, 0, rate, fast, 2.0, None).fetch
    with pytest.raises(ValueError, match="auto"):
        decide("sometimes", 1, 1, rate, fast, 1.0, None)


def view(wid, matched, **kw):
    return WorkerView(worker_id=wid, address=f"h:{wid}", matched_blocks=matched, **kw)


def test_prefix_holder():
    a, b, c = view("a", 10), view("b", 0), view("c", 4)
    assert prefix_holder(b, [a, b, c]) is a
    assert prefix_holder(a, [a, b, c]) is None  # the chosen worker holds the most
    assert prefix_holder(c, [a, b, c], min_extra_blocks=7) is None
    assert prefix_holder(c, [a, b, c], min_extra_blocks=6) is a
    assert prefix_holder(b, [b]) is None


@pytest.fixture(scope="module")
def pair():
    cfg = TierConfig(host_bytes=16 << 20)
    holder = Engine(num_blocks=128, block_size=BS, tiers=cfg).start()
    fetcher = Engine(num_blocks=128, block_size=BS, tiers=cfg).start()
    yield holder, fetcher
    holder.stop()
    fetcher.stop()


def as_msgs(records):
    return [pb.BlockData(block_hash=m.block_hash, parent_block_hash=m.parent_hash, token_ids=m.token_bytes,
                         codec=m.codec, dtype=m.dtype, shape=list(m.shape), checksum=m.payload_checksum,
                         payload=p, format_version=1) for m, p in records]


def test_exported_blocks_staged_on_another_engine_equal_cold(pair):
    """Blocks exported from the holder's device (first half) and host tier (second half),
    verified against the fetcher's own hashes, staged, then used as a peer hit."""
    holder, fetcher = pair
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(300)]
    sp = SamplingParams(max_tokens=10)
    fetcher.clear_cache()
    ref = fetcher.generate(prompt, sp)
    fetcher.clear_cache()
    holder.clear_cache()
    holder.generate(prompt[:160], SamplingParams(max_tokens=1))
    holder.offload_device_cache()  # blocks 0..9 in the host tier
    holder.generate(prompt, SamplingParams(max_tokens=1))  # 0..9 loaded back; all 18 on device
    holder.offload_device_cache()
    holder.generate(prompt[:100], SamplingParams(max_tokens=1))  # 0..5 on device, the rest only in host
    ns = fetcher.namespace()
    from kvmesh.cache_store.hashing import hash_blocks

    hashed = hash_blocks(prompt, BS, ns.root_hash())
    want = (len(prompt) - 1) // BS
    records = holder.export_blocks(hashed.hashes[:want])
    assert len(records) == want and {m.codec for m, _ in records} == {"none"}
    verified = [_verify(msg, i, hashed, ns.root_hash(), fetcher) for i, msg in enumerate(as_msgs(records))]
    assert fetcher.tiers.stage(verified) == want
    out = fetcher.generate(prompt, sp)
    assert out["usage"]["cached_tokens_by_tier"]["peer"] == BS * want
    assert out["token_ids"] == ref["token_ids"]
    assert fetcher.tier_stats()["peer_staged_blocks"] == 0  # consumed by the request
    fetcher.check_integrity()


def test_tampered_blocks_are_refused(pair):
    holder, fetcher = pair
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(100)]
    holder.clear_cache()
    holder.generate(prompt, SamplingParams(max_tokens=1))
    from kvmesh.cache_store.hashing import hash_blocks

    ns = fetcher.namespace()
    hashed = hash_blocks(prompt, BS, ns.root_hash())
    msgs = as_msgs(holder.export_blocks(hashed.hashes[:6]))
    for field, value, needle in [
        ("payload", None, "checksum"),
        ("token_ids", b"\x00" * 64, "token"),
        ("parent_block_hash", b"\x01" * 16, "parent"),
        ("shape", [4, 2, 2, 16, 32], "layout"),
        ("format_version", 9, "version"),
    ]:
        bad = pb.BlockData()
        bad.CopyFrom(msgs[3])
        if field == "payload":
            p = bytearray(bad.payload)
            p[100] ^= 1
            bad.payload = bytes(p)
        elif field == "shape":
            bad.shape[:] = value
        else:
            setattr(bad, field, value)
        with pytest.raises(RecordError, match=needle):
            _verify(bad, 3, hashed, ns.root_hash(), fetcher)
    other = fetcher.namespace(cache_salt="tenant-b")  # the right bytes under another namespace
    with pytest.raises(RecordError):
        _verify(msgs[0], 0, hash_blocks(prompt, BS, other.root_hash()), other.root_hash(), fetcher)



def _first_stop(arrivals, expected, deadline):
    """Replays block arrival times (seconds) through `FetchPace`; the block count at which
    an ``auto`` fetch would stop, or None if it runs to the end."""
    from kvmesh.workers.peer_fetch import FetchPace

    pace = FetchPace()
    for now in arrivals:
        pace.arrived(now)
        if pace.past_deadline(expected, deadline):
            return pace.received
    return None


def test_one_late_block_does_not_end_a_fetch_that_would_finish_in_time():
    """A busy host holds up the second block by 0.3 s; the other 31 blocks arrive 1 ms apart,
    so the fetch ends at 0.33 s, inside its 0.5 s deadline. Projected from the rate since the
    first block it would stop (0.1 s per block x 28 blocks to go, at the fourth block); the
    pace without the longest interval goes on and completes."""
    arrivals = [0.0, 0.3] + [0.3 + 0.001 * i for i in range(1, 31)]
    assert arrivals[-1] < 0.5
    assert _first_stop(arrivals, expected=32, deadline=0.5) is None
    # late blocks scattered through the fetch: two outliers are not one; it stops
    assert _first_stop([0.0, 0.3, 0.6, 0.601, 0.602] + [0.602 + 0.001 * i for i in range(1, 28)],
                       expected=32, deadline=0.7) is not None


def test_a_peer_slower_than_the_deadline_is_abandoned_after_a_few_blocks():
    from kvmesh.workers.peer_fetch import PROJECT_AFTER_BLOCKS

    arrivals = [0.01 + 0.1 * i for i in range(32)]  # 0.1 s per block: 3.11 s for 32 blocks
    assert _first_stop(arrivals, expected=32, deadline=1.0) == PROJECT_AFTER_BLOCKS
    # the same peer and a deadline it meets: never stopped
    assert _first_stop(arrivals, expected=32, deadline=4.0) is None
    # a fetch of fewer blocks than the probe is never projected (its deadline still bounds it)
    assert _first_stop(arrivals[:3], expected=3, deadline=0.05) is None
