"""vLLM KV event batches: decoding, applying to the index, the ZMQ subscriber.

Payloads are built two ways: by vLLM's own ``KVEventBatch`` classes and msgspec encoder
in vLLM's virtualenv (when ``scripts/setup.sh`` made it), and by hand from the format
documented in `services.vllm_events` for the tests that need no vLLM.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import msgpack
import pytest

from kvmesh.bench.vllm_peer import vllm_python, vllm_ready
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.vllm_compat import VllmHashConfig, VllmHasher, event_key
from kvmesh.services.vllm_events import VllmEventSubscriber, decode_vllm_batch

VLLM_PY = vllm_python()


def _stored(hashes, parent, tokens, bs, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "lora_id": None, "medium": medium, "lora_name": None}


def _payload(events, ts=None):
    return msgpack.packb([time.time() if ts is None else ts, events], use_bin_type=True)


def test_decode_map_and_array_forms():
    p = _payload([_stored([1, 2], None, list(range(8)), 4),
                  {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
                  ["BlockStored", [3], 1, [0, 1, 2, 3], 4, None, "CPU"],
                  {"type": "AllBlocksCleared"}])
    b = decode_vllm_batch(p)
    kinds = [type(e).__name__ for e in b.events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    assert b.events[0].block_hashes == [event_key(1), event_key(2)]
    assert b.events[2].medium == "host" and b.events[2].parent_block_hash == event_key(1)
    assert b.root_blocks == [(event_key(1), [0, 1, 2, 3], None)]
    assert b.block_sizes == {4}


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"a": 1}),
                                     msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                                           "medium": "TAPE"}]])])
def test_bad_payloads_raise_value_error(payload):
    with pytest.raises(ValueError):
        decode_vllm_batch(payload)


def test_apply_counts_gaps_and_restarts():
    h = VllmHasher(VllmHashConfig(block_size=4))
    toks = list(range(12))
    keys = h.keys(toks)
    ints = [int.from_bytes(k, "big") for k in keys]
    idx = ClusterIndex()
    checked = []

    def check(key, tokens, extra):
        checked.append(key)
        return h.digest_key(h.hash_block(None, tokens)) == key

    sub = VllmEventSubscriber(idx, "a", "tcp://127.0.0.1:1", check_root=check)
    assert sub.apply(5, _payload([_stored(ints[:2], None, toks[:8], 4)]))
    assert idx.match(keys, 0.0)["a"].num_blocks == 2
    assert sub.hash_checks == 1 and sub.hash_mismatches == 0 and checked == [keys[0]]
    assert sub.apply(8, _payload([_stored(ints[2:], ints[1], toks[8:], 4)]))   # 6, 7 missed
    assert sub.gaps == 1 and idx.match(keys, 0.0)["a"].num_blocks == 3
    assert sub.apply(9, _payload([{"type": "BlockRemoved", "block_hashes": [ints[1]], "medium": "GPU"}]))
    assert idx.match(keys, 0.0)["a"].num_blocks == 1
    assert sub.apply(0, _payload([]))       # the server restarted: its entries are gone
    assert sub.restarts == 1 and idx.match(keys, 0.0)["a"].num_blocks == 0
    # a root block whose hash our settings do not reproduce is counted
    assert sub.apply(1, _payload([_stored([123], None, toks[:4], 4)]))
    assert sub.hash_mismatches == 1
    assert not sub.apply(2, b"\x00garbage")
    assert sub.decode_errors == 1


async def _publish_and_read(payloads):
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = ClusterIndex()
    sub = VllmEventSubscriber(idx, "srv", f"tcp://127.0.0.1:{port}")
    sub.start()
    await sub.connected.wait()
    try:
        # PUB drops messages until the subscription reached it: send a probe until one arrives
        deadline = time.monotonic() + 10
        seq = 0
        while sub.batches == 0:
            assert time.monotonic() < deadline, "subscriber never received a batch"
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), _payload([])])
            seq += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        base = sub._last_vllm_seq + 1
        for i, p in enumerate(payloads):
            await pub.send_multipart([b"", (base + i).to_bytes(8, "big"), p])
        deadline = time.monotonic() + 10
        while sub._last_vllm_seq < base + len(payloads) - 1:
            assert time.monotonic() < deadline, "batches did not arrive"
            await asyncio.sleep(0.02)
        return idx, sub
    finally:
        await sub.stop()
        pub.close(0)
        ctx.term()


def test_zmq_subscriber_feeds_index():
    h = VllmHasher(VllmHashConfig(block_size=4))
    toks = list(range(16))
    keys = h.keys(toks)
    ints = [int.from_bytes(k, "big") for k in keys]
    idx, sub = asyncio.run(_publish_and_read([
        _payload([_stored(ints[:3], None, toks[:12], 4)]),
        _payload([{"type": "BlockRemoved", "block_hashes": [ints[2]], "medium": "GPU"}]),
    ]))
    assert idx.match(keys, 0.0)["srv"].num_blocks == 2
    assert sub.gaps == 0 and sub.decode_errors == 0


_VLLM_ENCODE = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
spec = json.load(sys.stdin)
evs = [BlockStored(block_hashes=spec["hashes"], parent_block_hash=None, token_ids=spec["tokens"],
                   block_size=spec["bs"], lora_id=None, medium="GPU", lora_name=None),
       BlockRemoved(block_hashes=spec["hashes"][1:], medium="GPU"), AllBlocksCleared()]
sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=12.5, events=evs)))
"""


@pytest.mark.skipif(not vllm_ready(), reason="no vLLM virtualenv (scripts/setup.sh makes it)")
@pytest.mark.slow
def test_decodes_vllm_own_encoding():
    spec = {"hashes": [11, 22, 1 << 63], "tokens": list(range(6)), "bs": 2}
    proc = subprocess.run([str(VLLM_PY), "-c", _VLLM_ENCODE], input=json.dumps(spec).encode(),
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    b = decode_vllm_batch(proc.stdout)
    assert b.ts == 12.5
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert b.events[0].block_hashes == [event_key(x) for x in spec["hashes"]]
    assert b.events[0].token_ids == spec["tokens"] and b.events[0].medium == "device"
    assert b.events[1].block_hashes == [event_key(x) for x in spec["hashes"][1:]]
