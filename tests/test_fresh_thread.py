"""Torch work off the engine thread runs on short-lived threads (`cache_store.fresh_thread`).

An idle OpenMP team left on a long-lived thread slows the engine's steps
(``bench.omp_teams`` measures it); these tests check the helpers' semantics and that the
disk writer's encoding and the worker's block export use them: the thread that ran the
torch work has exited by the time the result is used, and is neither the writer loop nor
an executor thread.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvmesh.cache_store import tier_store as tier_store_mod
from kvmesh.cache_store.fresh_thread import run_on_fresh_thread, to_fresh_thread
from kvmesh.cache_store.tier_store import TierConfig
from kvmesh.workers.engine import Engine
from kvmesh.workers.request import SamplingParams

BS = 16


def test_run_on_fresh_thread_returns_raises_and_leaves_no_thread():
    seen = []

    def work(x, y=1):
        seen.append(threading.current_thread())
        return x + y

    assert run_on_fresh_thread(work, 2, y=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="boom"):
        run_on_fresh_thread(lambda: {}["boom"])


def test_to_fresh_thread_keeps_the_event_loop_running():
    async def main():
        seen, ticks = [], []
        release = threading.Event()

        def work():
            seen.append(threading.current_thread())
            assert release.wait(10)
            return "done"

        async def ticker():
            while not release.is_set():
                ticks.append(1)
                if len(ticks) >= 3:
                    release.set()
                await asyncio.sleep(0.01)

        out, _ = await asyncio.gather(to_fresh_thread(work), ticker())
        with pytest.raises(ZeroDivisionError):
            await to_fresh_thread(lambda: 1 / 0)
        return out, seen, ticks

    out, seen, ticks = asyncio.run(main())
    assert out == "done" and len(ticks) >= 3  # the loop ran while work() blocked
    deadline = time.monotonic() + 10
    while seen[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not seen[0].is_alive()


def test_disk_writer_encodes_on_short_lived_threads(tmp_path, monkeypatch):
    threads = []
    real = tier_store_mod.TierStore._records

    def recording(self, batch, codec):
        threads.append(threading.current_thread())
        return real(self, batch, codec)

    monkeypatch.setattr(tier_store_mod.TierStore, "_records", recording)
    block_bytes = 4 * 2 * 2 * BS * 64 * 4  # built-in model, float32
    e = Engine(num_blocks=32, block_size=BS, tiers=TierConfig(
        host_bytes=16 * block_bytes, disk_dir=str(tmp_path), disk_bytes=64 << 20, peer_bytes=0)).start()
    try:
        e.generate(list(range(1, 100)), SamplingParams(max_tokens=2))
        e.offload_device_cache()
        assert e.tiers.flush(30)
        assert e.tiers.stats()["disk_blocks"] > 0
    finally:
        e.stop()
    assert threads
    names = {t.name for t in threads}
    assert names == {"kvmesh-encode"}, names
    assert not any(t.is_alive() for t in threads)


def test_worker_exports_blocks_on_short_lived_threads(monkeypatch):
    """FetchBlocks through the worker's servicer: export_blocks runs on a fresh thread."""
    from kvmesh.cache_store.hashing import hash_blocks
    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.workers.server import WorkerServicer

    e = Engine(num_blocks=32, block_size=BS).start()
    try:
        prompt = list(range(1, 70))
        e.generate(prompt, SamplingParams(max_tokens=1))
        hashes = hash_blocks(prompt, BS, e.namespace().root_hash()).hashes
        threads = []
        real = e.export_blocks

        def recording(*a, **kw):
            threads.append(threading.current_thread())
            return real(*a, **kw)

        monkeypatch.setattr(e, "export_blocks", recording)
        servicer = WorkerServicer(e, "w0", "127.0.0.1:1")

        class Ctx:  # no gate: the servicer treats the caller as a peer
            async def abort(self, code, details):
                raise AssertionError(f"{code}: {details}")

        async def fetch():
            return [b async for b in servicer.FetchBlocks(pb.FetchBlocksRequest(block_hashes=hashes), Ctx())]

        blocks = asyncio.run(fetch())
    finally:
        e.stop()
    assert [b.block_hash for b in blocks] == hashes
    assert threads and {t.name for t in threads} == {"kvmesh-export"}
    assert not any(t.is_alive() for t in threads)
