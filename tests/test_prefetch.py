"""Prefetch: disk (and remote) blocks are read in the submitter's thread and staged, so the
engine thread never reads the disk for them; every path still equals a cold run."""
from __future__ import annotations

import os
import threading

from kvmesh.cache_store.hashing import hash_blocks
from kvmesh.cache_store.tier_store import TierConfig
from tests.test_engine_tiers import BLOCK_BYTES, BS, cap_blocks, max_diff, rand_prompt, run, spy_disk_reads
from kvmesh.workers.engine import Engine


def disk_engine(tmp_path, peer_bytes=16 << 20) -> Engine:
    return Engine(num_blocks=64, block_size=BS,
                  tiers=TierConfig(host_bytes=48 * BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=64 << 20,
                                   peer_bytes=peer_bytes)).start()


def push_to_disk_only(e: Engine, prompt) -> None:
    run(e, prompt + [7])
    e.offload_device_cache()
    assert e.flush_tiers(30)
    e.drop_host_tier()


def test_disk_hit_is_read_by_the_submitter_not_the_engine(tmp_path):
    e = disk_engine(tmp_path)
    try:
        prompt = rand_prompt(21, 180)
        e.clear_cache()
        ref, ref_logits = run(e, prompt)
        push_to_disk_only(e, prompt)
        readers = spy_disk_reads(e)
        out, logits = run(e, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["disk"] == BS * cap_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"] and max_diff(logits, ref_logits) < 1e-4
        assert readers == [threading.current_thread().name]  # one read, here; none on the engine thread
        assert e.tier_stats().get("peer_staged_blocks", 0) == 0  # consumed by the load
        e.check_integrity()
    finally:
        e.stop()


def test_without_a_staging_area_the_engine_reads_the_disk_itself(tmp_path):
    e = disk_engine(tmp_path, peer_bytes=0)
    try:
        prompt = rand_prompt(22, 150)
        e.clear_cache()
        ref, _ = run(e, prompt)
        push_to_disk_only(e, prompt)
        readers = spy_disk_reads(e)
        out, _ = run(e, prompt)
        assert out["usage"]["cached_tokens_by_tier"]["disk"] == BS * cap_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
        assert len(readers) == 1 and readers[0] != threading.current_thread().name
    finally:
        e.stop()


def test_damaged_segment_found_by_prefetch_is_dropped_and_recomputed(tmp_path):
    e = disk_engine(tmp_path)
    try:
        prompt = rand_prompt(23, 120)
        e.clear_cache()
        ref, _ = run(e, prompt)
        push_to_disk_only(e, prompt)
        hashes = hash_blocks(prompt, BS, e.namespace().root_hash()).hashes
        entry = e.tiers.disk.entries[hashes[3]]
        seg = e.tiers.disk.segments[entry.segment]
        with open(seg.path, "r+b") as f:  # flip one payload byte of block 3
            f.seek(entry.offset + entry.meta.record_len - 1)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        out, _ = run(e, prompt)
        assert out["token_ids"] == ref["token_ids"]
        assert out["usage"]["cached_tokens_by_tier"]["disk"] == 3 * BS  # blocks 0-2 staged, the rest computed
        assert e.tier_stats()["disk_damaged"] == 1 and not os.path.exists(seg.path)
        e.check_integrity()
    finally:
        e.stop()


def test_prefetch_leaves_host_blocks_and_stages_only_the_disk_ones(tmp_path):
    """Blocks 0..k in host memory, the rest on disk only: prefetch stages the disk part, and
    the request is credited host for the first and disk for the rest."""
    e = disk_engine(tmp_path)
    try:
        prompt = rand_prompt(24, 200)
        e.clear_cache()
        ref, _ = run(e, prompt)
        push_to_disk_only(e, prompt)
        run(e, prompt[:81])  # blocks 0-4 back on device (from disk) ...
        e.offload_device_cache()  # ... and into host memory
        staged = e.prefetch(prompt)
        assert staged == {"disk": cap_blocks(prompt) - 5}
        out, _ = run(e, prompt)
        by = out["usage"]["cached_tokens_by_tier"]
        assert by["host"] == 5 * BS and by["disk"] == BS * (cap_blocks(prompt) - 5)
        assert out["token_ids"] == ref["token_ids"]
    finally:
        e.stop()


def test_a_clear_during_a_prefetch_leaves_nothing_staged(tmp_path):
    e = disk_engine(tmp_path)
    try:
        prompt = rand_prompt(25, 200)
        push_to_disk_only(e, prompt)
        real = e.tiers._read_disk

        def read_then_clear(entries):  # the clear lands between the disk read and the staging
            got = real(entries)
            clearing = threading.Thread(target=e.clear_cache)
            clearing.start()
            clearing.join(60)  # wait for the clear itself, however slow the machine (not a nap)
            assert not clearing.is_alive(), "clear_cache did not finish while a prefetch was reading"
            return got

        e.tiers._read_disk = read_then_clear
        assert e.prefetch(prompt) == {"disk": 0}
        e.tiers._read_disk = real
        assert e.tier_stats().get("peer_staged_blocks", 0) == 0 and e.tier_stats()["disk_blocks"] == 0
        out, _ = run(e, prompt)
        assert out["usage"]["cached_tokens"] == 0
    finally:
        e.stop()


def test_prefetch_reads_no_more_than_the_staging_area_holds(tmp_path):
    e = disk_engine(tmp_path, peer_bytes=4 * BLOCK_BYTES)
    try:
        prompt = rand_prompt(26, 300)
        e.clear_cache()
        ref, _ = run(e, prompt)
        push_to_disk_only(e, prompt)
        read = []
        real = e.tiers.disk.read
        e.tiers.disk.read = lambda entries: read.append(len(entries)) or real(entries)
        assert e.prefetch(prompt) == {"disk": 4}
        assert read == [4]
        out, _ = run(e, prompt)  # the rest is read in scheduling
        assert out["usage"]["cached_tokens_by_tier"]["disk"] == BS * cap_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
    finally:
        e.stop()


def test_write_queue_is_bounded_and_never_waited_for(tmp_path):
    """With the disk writer stuck (fault injected), offload queues at most
    max_pending_write_bytes and skips the rest; nothing waits, and every pin is returned
    once the writer moves again."""
    import torch

    from kvmesh.cache_store.prefix_cache import EvictedBlock
    from kvmesh.cache_store.tier_store import TierStore
    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.model import allocate_kv_cache

    kv = allocate_kv_cache(ModelConfig.tiny(), 32, BS, "cpu", torch.float32).normal_()
    store = TierStore(kv, TierConfig(host_bytes=16 * BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=64 << 20,
                                     peer_bytes=0, max_pending_write_bytes=5 * BLOCK_BYTES))
    gate = threading.Event()
    outwaited = []  # write batches whose gate gave up (30 s): only if the test waited for the writer
    real = store._write_batch

    def stuck_write(groups):
        if not gate.wait(30):
            outwaited.append(len(groups))
        return real(groups)

    store._write_batch = stuck_write
    try:
        blocks = [EvictedBlock(i, bytes([i + 1]) * 16, None, bytes(4 * BS)) for i in range(12)]
        store.offload(blocks)
        # offload returned while the writer was still stuck: the gate opens only below, so an
        # offload that waited for the writer would have returned only after the gate gave up
        assert outwaited == [], "offload waited for the stuck disk writer"
        st = store.stats()
        assert st["writes_skipped"] == 7 and st["pending_write_bytes"] == 5 * BLOCK_BYTES
        gate.set()
        assert store.flush(30)
        st = store.stats()
        assert st["disk_blocks"] == 5 and st["pending_write_bytes"] == 0
        assert sum(store.host._pins) == 0
    finally:
        gate.set()
        store.close()
