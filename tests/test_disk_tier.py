"""Disk tier: segments written atomically, re-indexed at start, damage detected and dropped,
byte cap with segment LRU, and a process SIGKILLed mid-write never leaves a torn block."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import stat
import textwrap
import threading
import time

import pytest

from kvmesh.cache_store.block_record import ZERO_HASH, RecordMeta, checksum
from kvmesh.cache_store.disk_tier import LOCK_NAME, SEGMENT_HEADER_BYTES, DiskTier, SegmentReadError
from kvmesh.cache_store.hashing import Namespace, hash_blocks

SHAPE = (4, 2, 2, 16, 64)
PAYLOAD = 4096  # small payloads keep the files small; the tier does not care about the codec size


def items(n, seed=0, size=PAYLOAD, shape=SHAPE, codec="none"):
    rng = random.Random(seed)
    bh = hash_blocks([rng.randrange(256) for _ in range(16 * n)], 16, Namespace("m").root_hash())
    out = []
    for i in range(n):
        payload = rng.randbytes(size)
        meta = RecordMeta(bh.hashes[i], bh.hashes[i - 1] if i else ZERO_HASH, bh.block_tokens(i),
                          codec(i) if callable(codec) else codec, "float32", shape, len(payload), checksum(payload))
        out.append((meta, payload))
    return out


def write(tier, its):
    seg = tier.write_segment(tier.new_segment_id(), its)
    return tier.add_segment(seg, [m for m, _ in its])


_open: dict[str, DiskTier] = {}


def reopen(path, cap=1 << 30, shape=SHAPE, **kw) -> DiskTier:
    """A tier on ``path`` as a restarted worker gets it: the previous one here gives the
    directory's lock up first, as a worker does when it stops (or the kernel, when it dies)."""
    prev = _open.pop(os.path.abspath(str(path)), None)
    if prev is not None:
        prev.release()
    t = _open[os.path.abspath(str(path))] = DiskTier(str(path), cap, shape, "float32", **kw)
    return t


def new_tier(path, cap=1 << 30, **kw):
    t = reopen(path, cap, **kw)
    t.scan()
    return t


def files(path) -> list[str]:
    """The directory's entries but the tier's lock file."""
    return [f for f in os.listdir(path) if f != LOCK_NAME]


def test_write_scan_read(tmp_path):
    t = new_tier(tmp_path)
    its = items(6)
    added, removed = write(t, its[:4])
    assert len(added) == 4 and not removed
    write(t, its[2:])  # two already on disk: kept in their first segment
    assert len(t.entries) == 6 and len(t.segments) == 2
    t2 = new_tier(tmp_path)  # a restart re-indexes both segments
    assert set(t2.entries) == {m.block_hash for m, _ in its}
    payloads = t2.read([t2.entries[m.block_hash] for m, _ in its])
    assert [bytes(p) for p in payloads] == [p for _, p in its]
    assert t2.used_bytes == sum(os.path.getsize(tmp_path / f) for f in files(tmp_path))


def test_segments_are_readable_by_this_user_only(tmp_path):
    """Segments hold prompts' token ids and KV: a folder the tier makes is 0700 and segment
    files are 0600 (other local users, e.g. other tenants' jobs on a shared host, cannot
    read them). A folder given (a shared mount, /tmp) keeps its mode; segments written
    before files were private are made so at the next start."""
    fresh = new_tier(tmp_path / "new" / "disk")
    write(fresh, items(2))
    assert os.stat(tmp_path / "new" / "disk").st_mode & 0o777 == 0o700
    assert all(os.stat(tmp_path / "new" / "disk" / f).st_mode & 0o777 == 0o600
               for f in files(tmp_path / "new" / "disk"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    t = new_tier(shared)
    write(t, items(2))
    assert os.stat(shared).st_mode & 0o7777 == 0o1777
    seg = next(f for f in files(shared) if f.startswith("seg-"))
    os.chmod(shared / seg, 0o644)  # as an earlier version wrote it
    new_tier(shared)
    assert os.stat(shared / seg).st_mode & 0o777 == 0o600


def test_truncated_segment_is_dropped_at_start(tmp_path):
    t = new_tier(tmp_path)
    write(t, items(3, seed=1))
    write(t, items(3, seed=2))
    path = sorted(files(tmp_path))[0]
    size = os.path.getsize(tmp_path / path)
    os.truncate(tmp_path / path, size - 100)
    t2 = new_tier(tmp_path)
    assert t2.num_damaged == 1 and not (tmp_path / path).exists()
    assert set(t2.entries) == {m.block_hash for m, _ in items(3, seed=2)}


def test_corrupted_payload_is_detected_on_read(tmp_path):
    t = new_tier(tmp_path)
    its = items(4, seed=3)
    write(t, its)
    (seg,) = t.segments.values()
    with open(seg.path, "r+b") as f:  # flip one byte inside block 2's payload
        e = t.entries[its[2][0].block_hash]
        f.seek(e.offset + e.meta.record_len - 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    t2 = new_tier(tmp_path)  # headers are intact: indexed
    assert len(t2.entries) == 4
    with pytest.raises(SegmentReadError) as err:
        t2.read([t2.entries[m.block_hash] for m, _ in its])
    assert err.value.index == 2 and err.value.damaged
    assert [bytes(p) for p in t2.read([t2.entries[m.block_hash] for m, _ in its[:2]])] == [p for _, p in its[:2]]
    dropped = t2.drop_segment(err.value.segment)
    assert len(dropped) == 4 and not os.path.exists(seg.path) and not t2.entries


@pytest.mark.parametrize("damage", ["segment magic", "segment header", "record header", "trailing bytes"])
def test_damaged_segments_are_dropped_at_start(tmp_path, damage, caplog):
    t = new_tier(tmp_path)
    write(t, items(2, seed=4))
    (seg,) = t.segments.values()
    with open(seg.path, "r+b") as f:
        if damage == "segment magic":
            f.write(b"XXXX")
        elif damage == "segment header":
            f.seek(9)
            f.write(b"\xff")
        elif damage == "record header":
            f.seek(SEGMENT_HEADER_BYTES + 30)
            f.write(b"\xff")
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"junk")
    t2 = reopen(tmp_path)
    with caplog.at_level("WARNING", logger="kvmesh.cache_store.disk_tier"):
        assert t2.scan() == [] and t2.num_damaged == 1 and not files(tmp_path)
    assert "deleting damaged segment" in caplog.text


def test_leftover_tmp_files_are_removed(tmp_path):
    t = new_tier(tmp_path)
    write(t, items(2))
    (tmp_path / "seg-00000000000000ff.1234.tmp").write_bytes(b"KVS1 half a segment")
    t2 = new_tier(tmp_path)
    assert t2.num_torn == 1 and len(t2.entries) == 2
    assert not [f for f in files(tmp_path) if f.endswith(".tmp")]


def test_capacity_evicts_least_recently_used_segment(tmp_path):
    its = [items(2, seed=s) for s in range(4)]
    seg_size = SEGMENT_HEADER_BYTES + sum(m.record_len for m, _ in its[0])
    t = new_tier(tmp_path, cap=3 * seg_size)
    for group in its[:3]:
        write(t, group)
    t.touch(its[0][0][0].block_hash)  # segment 0 becomes the most recently used
    _, removed = write(t, its[3])
    assert {m.block_hash for m in removed} == {m.block_hash for m, _ in its[1]}
    assert t.used_bytes <= t.capacity_bytes and len(files(tmp_path)) == 3
    assert its[0][0][0].block_hash in t.entries


CHILD = textwrap.dedent("""
    import os, random, sys
    sys.path.insert(0, {root!r})
    from kvmesh.cache_store.block_record import ZERO_HASH, RecordMeta, checksum
    from kvmesh.cache_store.disk_tier import DiskTier
    from kvmesh.cache_store.hashing import Namespace, hash_blocks
    SHAPE = (4, 2, 2, 16, 64)
    t = DiskTier({path!r}, 1 << 40, SHAPE, "float32")
    t.scan()
    rng = random.Random(0)
    payload = os.urandom(8 << 20)
    n = 0
    while True:  # 8 segments of 8 MiB blocks each, forever: the parent kills us mid-write
        bh = hash_blocks([rng.randrange(256) for _ in range(16 * 8)], 16, Namespace("m").root_hash())
        its = [(RecordMeta(bh.hashes[i], bh.hashes[i - 1] if i else ZERO_HASH, bh.block_tokens(i), "none",
                           "float32", SHAPE, len(payload), checksum(payload)), payload) for i in range(8)]
        seg = t.write_segment(t.new_segment_id(), its)
        t.add_segment(seg, [m for m, _ in its])
        n += 1
        print(n, flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_write_never_serves_a_torn_block(tmp_path):
    """A real process writing segments is SIGKILLed while a segment is half written; the next
    start sees only complete segments, every block it indexes reads back verified, and the
    unfinished file is removed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caught_mid_write = False
    for _attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=root, path=str(tmp_path))],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            proc.stdout.readline()  # one complete segment exists
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                tmps = [f for f in files(tmp_path) if f.endswith(".tmp")]
                if tmps and os.path.getsize(tmp_path / tmps[0]) > 0:
                    break
                time.sleep(0.0005)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        left = [f for f in files(tmp_path) if f.endswith(".tmp")]
        if left:
            caught_mid_write = True
            break
    assert caught_mid_write, "never caught the child mid-write"
    t = reopen(tmp_path, 1 << 40)
    metas = t.scan()
    assert t.num_torn >= 1 and t.num_damaged == 0
    assert not [f for f in files(tmp_path) if f.endswith(".tmp")]
    assert metas and len(metas) % 8 == 0  # only whole segments
    by_seg: dict = {}
    for e in t.entries.values():
        by_seg.setdefault(e.segment, []).append(e)
    for entries in by_seg.values():
        entries.sort(key=lambda e: e.offset)
        for p, e in zip(t.read(entries), entries):  # raises on any torn or corrupt block
            assert checksum(p) == e.meta.payload_checksum


def test_segment_eviction_is_fair_between_tenants(tmp_path):
    """Room for four segments of two blocks. Tenant "a" writes one segment (the oldest);
    tenant "b" then writes five: b's own two oldest segments go, never a's. Tenant-less segments
    (one tenant) are plain LRU."""
    its = items(12, seed=5)
    probe = new_tier(tmp_path / "probe")
    seg_bytes = probe.write_segment(probe.new_segment_id(), its[:2]).size
    t = new_tier(tmp_path / "t", cap=4 * seg_bytes)

    def put(pair, owner):
        seg = t.write_segment(t.new_segment_id(), pair)
        return t.add_segment(seg, [m for m, _ in pair], owner)

    put(its[0:2], "a")
    removed = []
    for k in range(2, 12, 2):
        removed += put(its[k:k + 2], "b")[1]
    assert {m.block_hash for m in removed} == {m.block_hash for m, _ in its[2:6]}  # b's two oldest segments
    assert all(m.block_hash in t.entries for m, _ in its[0:2])  # a's segment stays
    assert t.used_bytes <= 4 * seg_bytes
    solo = new_tier(tmp_path / "solo", cap=2 * seg_bytes)
    for k in range(0, 6, 2):
        seg = solo.write_segment(solo.new_segment_id(), its[k:k + 2])
        out = solo.add_segment(seg, [m for m, _ in its[k:k + 2]])[1]
    assert {m.block_hash for m in out} == {m.block_hash for m, _ in its[0:2]}  # the least recently used


def test_a_directory_serves_one_tier_at_a_time(tmp_path):
    """Two workers given one --disk-dir picked the same segment ids and deleted each other's
    files (every block the first had written came back a miss). The second is refused,
    naming the holder's pid; once the first gives the directory up (a stop, or its process
    dying: the kernel drops the flock), a restart takes it."""
    import subprocess
    import sys

    t = new_tier(tmp_path)
    with pytest.raises(ValueError, match=f"in use by another worker \\(pid {os.getpid()}\\)"):
        DiskTier(str(tmp_path), 1 << 30, SHAPE, "float32")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvmesh.cache_store.disk_tier import DiskTier\n"
            "try:\n    DiskTier(sys.argv[2], 1 << 30, (4, 2, 2, 16, 64), 'float32')\n"
            "except ValueError as e:\n    print(e); sys.exit(3)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = subprocess.run([sys.executable, "-c", code, root, str(tmp_path)], capture_output=True, text=True)
    assert other.returncode == 3 and "in use" in other.stdout, other
    t.release()
    assert subprocess.run([sys.executable, "-c", code, root, str(tmp_path)]).returncode == 0
    new_tier(tmp_path)


def test_segments_of_another_kv_producer_are_left_in_place_and_not_indexed(tmp_path):
    """A disk folder moved to a node with another GPU, reused by an image with another torch
    or a worker started with another --threads: what it holds was computed by other kernels
    and would not equal this worker's cold run. Those segments are foreign: not indexed, not
    deleted, counted toward the cap; a start with their producer indexes them again."""
    t = new_tier(tmp_path)
    assert t.adopt_producer("aaaa0000") == 0
    a_items = items(2, seed=7)
    write(t, a_items)
    t.release()
    t2 = reopen(tmp_path)
    assert t2.adopt_producer("aaaa0000") == 0 and len(t2.scan()) == 2  # same producer: kept
    t2.release()
    t3 = reopen(tmp_path)
    assert t3.adopt_producer("bbbb1111") == 1 and t3.scan() == []  # another: not indexed...
    assert len(t3.foreign) == 1 and t3.used_bytes == t3.foreign_bytes > 0  # ...but kept and counted
    b_items = items(3, seed=8)
    write(t3, b_items)
    t3.release()
    t4 = reopen(tmp_path)
    assert t4.adopt_producer("bbbb1111") == 1
    assert {m.block_hash for m in t4.scan()} == {m.block_hash for m, _ in b_items}
    t4.release()
    t5 = reopen(tmp_path)  # back to the first producer: its segment is indexed again, the other's is foreign
    assert t5.adopt_producer("aaaa0000") == 1
    assert {m.block_hash for m in t5.scan()} == {m.block_hash for m, _ in a_items}
    t5.release()
    # a folder of the earlier one-line format: every segment is that producer's
    (tmp_path / DiskTier.PRODUCER_NAME).write_text("aaaa0000\n")
    t6 = reopen(tmp_path)
    assert t6.adopt_producer("aaaa0000") == 0 and len(t6.scan()) == 5


def scan_within(tier: DiskTier, seconds: float = 20.0) -> list:
    """``tier.scan()``, failing the test if it has not returned within ``seconds``."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("metas", tier.scan()), daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "the scan hung"
    return out["metas"]


def test_scan_never_follows_links_nor_waits_on_special_files(tmp_path, caplog):
    """A symlink named like a segment (to a file outside the folder), a FIFO and a directory
    of such names are left alone: not followed, not chmodded, not opened for reading, not
    indexed, not deleted; the real segment next to them is indexed, and new segment ids
    never land on their names. A root worker once made /etc/passwd 0600 through such a
    link, and hung on a FIFO before listening."""
    d = tmp_path / "disk"
    t = new_tier(d)
    its = items(2, seed=11)
    write(t, its)
    (seg,) = t.segments.values()
    outside = tmp_path / "outside.kvs"
    outside.write_bytes(open(seg.path, "rb").read())  # a valid segment, even
    os.chmod(outside, 0o644)
    before = os.stat(outside)
    os.symlink(outside, d / "seg-00000000000000fe.kvs")
    os.mkfifo(d / "seg-00000000000000fd.kvs")
    os.mkdir(d / "seg-00000000000000fc.kvs")
    os.symlink(outside, d / "seg-00000000000000fb.99.tmp")
    t2 = reopen(d)
    try:
        with caplog.at_level("WARNING", logger="kvmesh.cache_store.disk_tier"):
            metas = scan_within(t2)
    finally:  # a scan blocked in open() of the FIFO would wait for a writer forever
        try:
            os.close(os.open(d / "seg-00000000000000fd.kvs", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert {m.block_hash for m in metas} == {m.block_hash for m, _ in its}
    assert len(t2.segments) == 1 and not t2.foreign and t2.num_damaged == 0 and t2.num_torn == 0
    after = os.stat(outside)
    assert stat.S_IMODE(after.st_mode) == 0o644 and after.st_size == before.st_size
    assert os.path.islink(d / "seg-00000000000000fe.kvs") and os.path.islink(d / "seg-00000000000000fb.99.tmp")
    assert stat.S_ISFIFO(os.lstat(d / "seg-00000000000000fd.kvs").st_mode)
    assert os.path.isdir(d / "seg-00000000000000fc.kvs")
    warnings = [r for r in caplog.records if "not regular files" in r.getMessage()]
    assert len(warnings) == 1 and "symlink" in warnings[0].getMessage() and "FIFO" in warnings[0].getMessage()
    assert t2.new_segment_id() > 0xFE  # never written over those names


def test_producer_file_and_producer_change_leave_special_files_alone(tmp_path):
    """The producer file is never followed nor waited on; emptying the folder for another
    producer deletes segment files only, not a directory or a link's target."""
    d = tmp_path / "disk"
    t = new_tier(d)
    assert t.adopt_producer("aaaa0000") == 0
    write(t, items(2, seed=12))
    os.mkdir(d / "seg-00000000000000fc.kvs")
    target = tmp_path / "keep"
    target.write_bytes(b"not a segment")
    os.symlink(target, d / "seg-00000000000000fe.kvs")
    t2 = reopen(d)
    assert t2.adopt_producer("bbbb1111") == 1
    assert os.path.isdir(d / "seg-00000000000000fc.kvs") and target.read_bytes() == b"not a segment"
    os.unlink(d / DiskTier.PRODUCER_NAME)
    os.mkfifo(d / DiskTier.PRODUCER_NAME)
    t3 = reopen(d)
    out: dict = {}

    def adopt():
        try:
            t3.adopt_producer("bbbb1111")
        except ValueError as exc:
            out["error"] = str(exc)

    th = threading.Thread(target=adopt, daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive(), "adopt_producer hung on a FIFO"
    assert "not a regular file" in out["error"]


def test_only_the_writers_own_tmp_files_are_removed(tmp_path):
    """Start-up removes the writer's unfinished files, ``seg-<16 hex>.<pid>.tmp`` regular
    files, and nothing else that happens to end in .tmp."""
    t = new_tier(tmp_path)
    write(t, items(2))
    (tmp_path / "notes.tmp").write_text("a user's notes")
    (tmp_path / "seg-00000000000000ff.tmp").write_bytes(b"x")
    (tmp_path / "seg-00000000000000ff.12x4.tmp").write_bytes(b"x")
    (tmp_path / "seg-00000000000000ff.1234.tmp").write_bytes(b"KVS1 half a segment")
    os.mkdir(tmp_path / "seg-00000000000000fe.77.tmp")
    t2 = new_tier(tmp_path)
    assert t2.num_torn == 1 and len(t2.entries) == 2
    assert sorted(f for f in files(tmp_path) if f.endswith(".tmp")) == [
        "notes.tmp", "seg-00000000000000fe.77.tmp", "seg-00000000000000ff.12x4.tmp", "seg-00000000000000ff.tmp"]


OTHER_SHAPE = (4, 2, 2, 32, 64)  # another --block-size


def test_segments_of_another_layout_are_left_in_place_and_evicted_first(tmp_path, caplog):
    """One start with another block size (or model shape, or dtype) must not wipe the tier:
    sound segments of another layout are neither indexed nor deleted, and a start with the
    first layout finds them again. Their bytes count toward the cap, and they are the first
    deleted, oldest first, when the tier needs room."""
    t = new_tier(tmp_path)
    write(t, items(2, seed=1))
    write(t, items(2, seed=2))
    seg_bytes = max(s.size for s in t.segments.values())
    other = reopen(tmp_path, cap=3 * seg_bytes, shape=OTHER_SHAPE)
    with caplog.at_level("WARNING", logger="kvmesh.cache_store.disk_tier"):
        assert other.scan() == []
    assert other.num_damaged == 0 and len(other.foreign) == 2 and not other.entries
    assert len([f for f in files(tmp_path) if f.endswith(".kvs")]) == 2
    assert other.used_bytes == other.foreign_bytes == 2 * seg_bytes
    assert "2 segment(s) of another layout, codec or KV producer left in place" in caplog.text
    assert "damaged" not in caplog.text

    back = new_tier(tmp_path)  # the mistake corrected: everything is there
    assert set(back.entries) == {m.block_hash for m, _ in items(2, seed=1) + items(2, seed=2)}

    other = reopen(tmp_path, cap=3 * seg_bytes, shape=OTHER_SHAPE)
    other.scan()
    oldest, newer = list(other.foreign.values())
    mine = [items(2, seed=s, shape=OTHER_SHAPE) for s in (20, 21, 22)]
    _, removed = write(other, mine[0])  # fits beside the foreign ones
    assert not removed and len(other.foreign) == 2
    _, removed = write(other, mine[1])  # over the cap: the oldest foreign segment goes, none of mine
    assert not removed and not os.path.exists(oldest.path) and os.path.exists(newer.path)
    assert other.used_bytes <= other.capacity_bytes and other.num_foreign_evicted == 1
    _, removed = write(other, mine[2])
    assert not removed and not other.foreign and not os.path.exists(newer.path)
    assert len(other.entries) == 6 and other.used_bytes == sum(s.size for s in other.segments.values())


def test_segments_of_another_codec_are_not_indexed(tmp_path):
    """A tier told which codecs its worker loads indexes no record of another codec: a
    segment of those only is left in place like one of another layout; a segment mixing
    them keeps serving the records it can."""
    t = new_tier(tmp_path)
    fp8 = items(2, seed=30, codec="fp8")
    mixed = items(4, seed=31, codec=lambda i: "fp8" if i % 2 else "none")
    write(t, fp8)
    write(t, mixed)
    exact = reopen(tmp_path, codecs={"none"})
    metas = exact.scan()
    assert {m.block_hash for m in metas} == {m.block_hash for m, _ in mixed if m.codec == "none"}
    assert len(exact.foreign) == 1 and len(exact.segments) == 1 and exact.num_damaged == 0
    both = reopen(tmp_path, codecs={"none", "fp8"})
    assert len(both.scan()) == 6 and not both.foreign


# -- through the tier store ------------------------------------------------------------------------

BS = 16
BLOCK_BYTES = 4 * 2 * 2 * BS * 64 * 4  # one float32 block of the built-in model


def _pool(num_blocks=32):
    import torch

    from kvmesh.workers.config import ModelConfig
    from kvmesh.workers.model import allocate_kv_cache

    return allocate_kv_cache(ModelConfig.tiny(), num_blocks, BS, "cpu", torch.float32)


def _chain(seed, n):
    """Hashes and block tokens of an ``n``-block prompt, and its namespace root."""
    rng = random.Random(seed)
    root = Namespace("m").root_hash()
    return hash_blocks([rng.randrange(256) for _ in range(BS * n)], BS, root), root


def _evicted(bh, rows):
    """`EvictedBlock`s of a chain whose block ``i`` sits in pool row ``rows[i]``, as the
    pool reports them (tails first)."""
    from kvmesh.cache_store.prefix_cache import EvictedBlock

    return [EvictedBlock(rows[i], bh.hashes[i], bh.hashes[i - 1] if i else None, bh.block_tokens(i))
            for i in reversed(range(len(rows)))]


def _store(kv, path, events=None, **kw):
    from kvmesh.cache_store.tier_store import TierConfig, TierStore

    kw.setdefault("host_bytes", 16 * BLOCK_BYTES)
    cfg = TierConfig(disk_dir=str(path), disk_bytes=64 << 20, peer_bytes=0, fsync=False, load_policy="always", **kw)
    return TierStore(kv, cfg, event_sink=None if events is None else events.append)


def _disk_stored(events) -> set:
    from kvmesh.cache_store.events import BlockStored

    return {h for ev in events if isinstance(ev, BlockStored) and ev.medium == "disk" for h in ev.block_hashes}


def test_a_worker_does_not_advertise_disk_blocks_of_a_codec_it_will_not_load(tmp_path):
    """Disk blocks written in fp8 by a worker run with --disk-codec fp8 are not indexed, not
    advertised and not located by a restart that loads exact KV only (the router would
    credit it with hits it never serves); a restart with fp8 again finds them all."""
    kv = _pool().normal_()
    bh, root = _chain(40, 6)
    store = _store(kv, tmp_path, disk_codec="fp8")
    try:
        store.offload(_evicted(bh, list(range(6))))
        assert store.flush(30) and store.stats()["disk_blocks"] == 6
    finally:
        store.close()
    for codec, found in (("none", 0), ("fp8", 6)):
        events: list = []
        store = _store(_pool(), tmp_path, events, disk_codec=codec)
        try:
            st = store.stats()
            assert st["disk_blocks"] == len(_disk_stored(events)) == found
            assert (st["disk_foreign_segments"] > 0) == (found == 0) and st["disk_damaged"] == 0
            located = store.locate(bh.hashes, bh.block_tokens, 0, 6, root)
            assert len(located) == found
            store.release(located)
        finally:
            store.close()


def test_write_back_stop_writes_the_host_tier_to_disk(tmp_path):
    """With write-back, blocks still only in host memory are written at a graceful stop, each
    chain parent first in one segment run; a restart on the folder loads them intact."""
    import torch

    kv = _pool().normal_()
    a, root = _chain(41, 5)
    b, _ = _chain(42, 3)
    store = _store(kv, tmp_path, write_mode="back")
    try:
        store.offload(_evicted(a, list(range(5))))
        store.offload(_evicted(b, list(range(5, 8))))
        assert store.flush(30) and store.stats()["disk_blocks"] == 0  # write-back: only in host memory
    finally:
        store.close()
    events: list = []
    again = _store(_pool(), tmp_path, events)
    try:
        assert _disk_stored(events) == set(a.hashes) | set(b.hashes)
        entries = [again.disk.entries[h] for h in a.hashes]
        assert len({e.segment for e in entries}) == 1
        assert all(e2.offset == e1.offset + e1.meta.record_len for e1, e2 in zip(entries, entries[1:]))
        located = again.locate(a.hashes, a.block_tokens, 0, 5, root)
        assert [loc.medium for loc in located] == ["disk"] * 5
        assert again.load(located, [10, 11, 12, 13, 14]) == ["disk"] * 5
        assert torch.equal(again.kv_cache[10:15], kv[0:5])
    finally:
        again.close()


def test_write_back_stop_is_bounded_in_time(tmp_path, caplog):
    """A disk that does not keep up cannot hold a stop: the host blocks not queued by the
    deadline are given up, and it says so."""
    kv = _pool().normal_()
    a, _ = _chain(43, 8)
    store = _store(kv, tmp_path, write_mode="back", max_pending_write_bytes=2 * BLOCK_BYTES)
    gate = threading.Event()
    real = store._write_batch
    store._write_batch = lambda groups: (gate.wait(60), real(groups))[1]
    writer = store._writer
    try:
        store.offload(_evicted(a, list(range(8))))
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="kvmesh.cache_store.tier_store"):
            store.close(timeout=0.5)
        assert time.monotonic() - started < 5
        assert "out of time" in caplog.text
    finally:
        gate.set()
        writer.join(30)
        store.disk.release()


def test_a_worker_stopped_gracefully_in_write_back_mode_restarts_warm(tmp_path):
    """docs/TIERS.md, "Graceful stop": with --disk-write-mode back, a worker restarted on the
    same folder after a graceful stop serves the prompt from disk, with the cold run's tokens."""
    from kvmesh.workers.engine import Engine
    from tests._device import DEVICE
    from tests.test_engine_tiers import GREEDY, TierConfig, cap_blocks, cold, rand_prompt, run

    def engine():
        return Engine(device=DEVICE, num_blocks=32, block_size=BS,
                      tiers=TierConfig(host_bytes=16 * BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=64 << 20,
                                       write_mode="back", peer_bytes=0)).start()

    prompt = rand_prompt(44, 100)
    e = engine()
    try:
        ref, _ = cold(e, prompt)
        assert e.tier_stats()["disk_blocks"] == 0
    finally:
        e.stop()
    e = engine()
    try:
        assert e.tier_stats()["disk_blocks"] >= cap_blocks(prompt)
        out, _ = run(e, prompt, GREEDY)
        assert out["usage"]["cached_tokens_by_tier"]["disk"] == BS * cap_blocks(prompt)
        assert out["token_ids"] == ref["token_ids"]
    finally:
        e.stop()


def test_write_through_stop_writes_the_blocks_whose_write_was_skipped(tmp_path):
    """Write-through skips writes past the write queue's cap (the device pool's offload at a
    stop overflows it at once); the stop writes those blocks too."""
    kv = _pool().normal_()
    a, _ = _chain(45, 8)
    store = _store(kv, tmp_path, max_pending_write_bytes=2 * BLOCK_BYTES)
    try:
        store.offload(_evicted(a, list(range(8))))
        assert store.stats()["writes_skipped"] > 0
    finally:
        store.close()
    again = _store(_pool(), tmp_path)
    try:
        assert set(again.disk.entries) == set(a.hashes)
    finally:
        again.close()


def test_a_full_filesystem_shrinks_the_tier_to_what_fits(tmp_path, caplog):
    """A segment write that fails with ENOSPC (injected: the filesystem fills before
    --disk-bytes) holds the tier to what is on disk less two segments and evicts down to it,
    so the next writes find room instead of failing again; the blocks evicted are reported
    removed (BlockRemoved 'disk')."""
    import errno
    import logging

    from kvmesh.cache_store.events import BlockRemoved

    kv = _pool().normal_()
    events: list = []
    store = _store(kv, tmp_path, events, segment_bytes=2 * BLOCK_BYTES)
    try:
        chains = [_chain(60 + i, 2)[0] for i in range(4)]
        for i, bh in enumerate(chains[:3]):
            store.offload(_evicted(bh, [2 * i, 2 * i + 1]))
            assert store.flush(30)
        assert store.stats()["disk_blocks"] == 6
        used = store.disk.used_bytes
        real_write = store.disk.write_segment

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        store.disk.write_segment = full
        with caplog.at_level(logging.WARNING, logger="kvmesh.cache_store.tier_store"):
            store.offload(_evicted(chains[3], [6, 7]))
            assert store.flush(30)
        assert store.stats()["write_errors"] == 1
        assert store.disk.capacity_bytes < used and store.disk.used_bytes <= store.disk.capacity_bytes
        assert "filesystem is full" in caplog.text
        removed = {h for ev in events if isinstance(ev, BlockRemoved) and ev.medium == "disk" for h in ev.block_hashes}
        assert removed and removed <= set(chains[0].hashes) | set(chains[1].hashes)
        store.disk.write_segment = real_write  # room again: the next write succeeds within the new cap
        bh, _ = _chain(70, 2)
        store.offload(_evicted(bh, [8, 9]))
        assert store.flush(30)
        assert all(h in store.disk.entries for h in bh.hashes)
        assert store.disk.used_bytes <= store.disk.capacity_bytes
    finally:
        store.close()


def test_failed_disk_writes_are_each_counted_but_logged_at_a_bounded_rate(tmp_path, caplog):
    """A disk that fails every write (injected EIO: a read-only or broken filesystem) under
    load: `write_errors` (the `disk_write_failures_total` metric) counts every failed segment
    write, while the log gets at most `LOG_BURST` lines per `LOG_WINDOW_S` seconds; the first
    line of the next window says how many were not logged."""
    import errno
    import logging

    from kvmesh.workers.grpc_guard import LOG_BURST, LOG_WINDOW_S

    kv = _pool().normal_()
    store = _store(kv, tmp_path)
    real_write = store.disk.write_segment

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    failures = 4 * LOG_BURST
    store.disk.write_segment = broken
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.cache_store.tier_store"):
            for i in range(failures):  # one block, so one segment write, each time
                bh, _ = _chain(200 + i, 1)
                store.offload(_evicted(bh, [i % 32]))
                assert store.flush(30)
            assert store.stats()["write_errors"] == failures
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert 1 <= len(lines) <= LOG_BURST, [r.getMessage() for r in lines]
            assert all("segment write failed" in r.getMessage() for r in lines)
            # the window is over (moved back rather than waited for): the next failure is
            # logged, with the count of those that were not
            store._write_error_log.window_start -= LOG_WINDOW_S
            caplog.clear()
            bh, _ = _chain(199, 1)
            store.offload(_evicted(bh, [0]))
            assert store.flush(30)
        assert store.stats()["write_errors"] == failures + 1
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert f"({failures - len(lines)} more failed disk segment writes not logged)" in line
        assert not store.disk.entries
    finally:
        store.disk.write_segment = real_write
        store.close()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
STRANGER = 65534  # nobody


@needs_root
def test_segments_of_another_owner_are_never_indexed_nor_read(tmp_path, caplog):
    """Block hashes are public functions of the prompt: a local user who can write the folder
    could plant records with valid checksums for a prompt another tenant will send. A segment
    owned by another user is skipped at start (left in place, warned about), and one swapped
    in under an indexed segment's name fails on read instead of serving its KV."""
    d = tmp_path / "disk"
    t = new_tier(d)
    mine, planted = items(2, seed=21), items(2, seed=22)
    write(t, mine)
    write(t, planted)
    by_name = sorted(f for f in files(d) if f.startswith("seg-"))
    os.chown(d / by_name[1], STRANGER, STRANGER)
    with caplog.at_level("WARNING", logger="kvmesh.cache_store.disk_tier"):
        t2 = new_tier(d)
    assert set(t2.entries) == {m.block_hash for m, _ in mine}
    assert (d / by_name[1]).exists()
    assert any("of another owner" in r.getMessage() and f"uid {STRANGER}" in r.getMessage() for r in caplog.records)
    # the indexed segment is replaced by a forged copy (same records, other owner) after the scan
    forged = d / "forged.kvs"
    forged.write_bytes((d / by_name[0]).read_bytes())
    os.chown(forged, STRANGER, STRANGER)
    os.replace(forged, d / by_name[0])
    with pytest.raises(SegmentReadError) as err:
        t2.read([t2.entries[m.block_hash] for m, _ in mine])
    assert err.value.damaged and "owned by uid" in str(err.value)


def test_a_folder_every_user_may_write_is_refused_unless_sticky(tmp_path):
    """Without the sticky bit, other users could delete or rename a worker's segments in a
    0777 folder: the tier refuses it, and the worker's flag check says how to fix it."""
    from kvmesh.services.cli_checks import disk_dir_problem

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ValueError, match="chmod o-w"):
        DiskTier(str(open_dir), 1 << 20, SHAPE, "float32")
    problem = disk_dir_problem(str(open_dir))
    assert problem is not None and "--disk-dir" in problem and "chmod o-w" in problem
    os.chmod(open_dir, 0o1777)
    assert disk_dir_problem(str(open_dir)) is None
    new_tier(open_dir)  # /tmp's mode: accepted
