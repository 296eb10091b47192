"""Disk tier: segments written atomically, re-indexed at start, damage detected and dropped,
byte cap with segment LRU, and a process SIGKILLed mid-write never leaves a torn block."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvmesh.cache_store.block_record import ZERO_HASH, RecordMeta, checksum
from kvmesh.cache_store.disk_tier import LOCK_NAME, SEGMENT_HEADER_BYTES, DiskTier, SegmentReadError
from kvmesh.cache_store.hashing import Namespace, hash_blocks

SHAPE = (4, 2, 2, 16, 64)
PAYLOAD = 4096  # small payloads keep the files small; the tier does not care about the codec size


def items(n, seed=0, size=PAYLOAD):
    rng = random.Random(seed)
    bh = hash_blocks([rng.randrange(256) for _ in range(16 * n)], 16, Namespace("m").root_hash())
    out = []
    for i in range(n):
        payload = rng.randbytes(size)
        meta = RecordMeta(bh.hashes[i], bh.hashes[i - 1] if i else ZERO_HASH, bh.block_tokens(i), "none", "float32",
                          SHAPE, len(payload), checksum(payload))
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


@pytest.mark.parametrize("damage", ["segment header", "record header", "trailing bytes", "foreign layout"])
def test_damaged_segments_are_dropped_at_start(tmp_path, damage):
    t = new_tier(tmp_path)
    write(t, items(2, seed=4))
    (seg,) = t.segments.values()
    if damage == "foreign layout":
        t2 = reopen(tmp_path, shape=(4, 2, 2, 16, 128))
    else:
        with open(seg.path, "r+b") as f:
            if damage == "segment header":
                f.seek(9)
                f.write(b"\xff")
            elif damage == "record header":
                f.seek(SEGMENT_HEADER_BYTES + 30)
                f.write(b"\xff")
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"junk")
        t2 = reopen(tmp_path)
    assert t2.scan() == [] and t2.num_damaged == 1 and not files(tmp_path)


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


def test_segments_of_another_kv_producer_are_dropped_at_start(tmp_path):
    """A disk folder moved to a node with another GPU, or reused by an image with another
    torch: what it holds was computed by other kernels and would not equal this worker's
    cold run. The folder records its producer; another one empties it before the scan."""
    t = new_tier(tmp_path)
    assert t.adopt_producer("aaaa0000") == 0
    write(t, items(2, seed=7))
    t2 = reopen(tmp_path)
    assert t2.adopt_producer("aaaa0000") == 0 and len(t2.scan()) == 2  # same producer: kept
    t3 = reopen(tmp_path)
    assert t3.adopt_producer("bbbb1111") == 1 and t3.scan() == []  # another: dropped
    t4 = reopen(tmp_path)
    assert t4.adopt_producer("bbbb1111") == 0
