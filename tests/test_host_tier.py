"""Host tier: slot allocation, LRU, pins (a slot being read is never reused), write-back
holds, and the batched copy in and out of the slab."""
from __future__ import annotations

import pytest
import torch

from kvmesh.cache_store.host_tier import HostEntry, HostTier
from kvmesh.cache_store.kv_codec import make_codec
from kvmesh.cache_store.prefix_cache import EvictedBlock

SHAPE = (2, 2, 1, 4, 8)


def tier(slots: int, codec: str = "none") -> HostTier:
    c = make_codec(codec, SHAPE, torch.float32)
    return HostTier(slots * c.payload_bytes + 7, c)


def block(name: bytes, parent: bytes | None = None) -> EvictedBlock:
    return EvictedBlock(0, name.ljust(16, b"."), parent, bytes(16))


def add(t: HostTier, name: bytes) -> HostEntry:
    (slot,), _, _ = t.reserve(1)
    t.insert(block(name), slot)
    e = t.get(name.ljust(16, b"."))
    assert e is not None and e.slot == slot
    return e


def test_capacity_lru_and_touch():
    t = tier(3)
    assert t.num_slots == 3
    a, b, c = (add(t, n) for n in (b"a", b"b", b"c"))
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    t.touch(a.block_hash)
    slots, evicted, held = t.reserve(2)
    assert evicted == [b.block_hash, c.block_hash]  # a was touched
    assert slots == [1, 2] and not held and a.block_hash in t
    assert t.used_bytes == t.codec.payload_bytes


def test_pinned_entries_are_not_evicted_and_slots_not_reused():
    t = tier(2)
    a, b = add(t, b"a"), add(t, b"b")
    t.pin(a.slot)
    slots, evicted, _ = t.reserve(2)
    assert slots == [b.slot] and evicted == [b.block_hash]
    t.release(slots)
    t.remove(a.block_hash)  # removed while pinned: the slot stays out of use
    assert t.reserve(2)[0] == [b.slot]
    t.unpin(a.slot)
    assert t.reserve(1)[0] == [a.slot]
    with pytest.raises(ValueError, match="not pinned"):
        t.unpin(a.slot)


def test_hold_keeps_an_evicted_slot_pinned():
    t = tier(2)
    a, b = add(t, b"a"), add(t, b"b")
    slots, evicted, held = t.reserve(1, hold=lambda slot: slot == a.slot)
    assert held == [a.slot] and t.view(a.slot).block_hash == a.block_hash  # still describable
    assert evicted == [a.block_hash, b.block_hash]
    assert slots == [b.slot]  # a's slot is held (pinned) for its write, not handed out
    t.unpin(a.slot)
    assert t.reserve(1)[0] == [a.slot]


def test_insert_checks():
    t = tier(2)
    a = add(t, b"a")
    with pytest.raises(ValueError, match="already"):
        t.insert(block(a.block_hash), 1)
    with pytest.raises(ValueError, match="not reserved"):
        t.insert(block(b"z" * 16), 1)
    (slot,), _, _ = t.reserve(1)
    with pytest.raises(ValueError, match="repeated"):
        t.insert_many([block(b"y"), block(b"y")], [slot, slot])
    assert len(t) == 1 and b"y".ljust(16, b".") not in t  # nothing changed on error


def test_views_blocks_and_disk_flag():
    t = tier(3)
    (s0, s1), _, _ = t.reserve(2)
    root, child = block(b"r"), block(b"c", parent=b"r".ljust(16, b"."))
    t.insert_many([root, child], [s0, s1])
    assert list(t.blocks()) == [(root.block_hash, None), (child.block_hash, root.block_hash)]
    e = t.get(root.block_hash)
    assert e.parent_hash == bytes(16) and e.origin == "host" and not e.on_disk
    t.set_on_disk(s1, True)
    assert t.get(child.block_hash).on_disk and not t.on_disk(s0)
    assert t.remove(child.block_hash) == s1 and t.get(child.block_hash) is None
    assert t.clear() == [root.block_hash] and len(t) == 0


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_store_and_load_scattered_blocks(codec):
    kv = torch.randn(10, *SHAPE)
    t = tier(8, codec)
    slots, _, _ = t.reserve(5)
    src = [7, 2, 9, 0, 4]
    t.store(kv, src, slots)
    out = torch.zeros_like(kv)
    dst = [1, 3, 5, 6, 8]
    t.load(out, list(reversed(slots)), list(reversed(dst)))  # any order, same pairing
    for s_id, d_id in zip(src, dst):
        if codec == "none":
            assert torch.equal(out[d_id], kv[s_id])
        else:
            assert float((out[d_id] - kv[s_id]).abs().max()) <= float(kv[s_id].abs().max()) / 8
    untouched = [i for i in range(10) if i not in dst]
    assert not out[untouched].any()


def test_eviction_is_fair_between_tenants():
    """Tenant "b" stored 2 blocks first (the oldest), "a" 6: making room for 4 evicts a's
    oldest four (plain LRU would take b's two first); pinned entries are skipped; with
    the tenants even, then the larger again. One tenant alone: plain LRU."""
    t = tier(8)

    def put(name: bytes, owner: str):
        (slot,), _, _ = t.reserve(1)
        t.insert(EvictedBlock(0, name.ljust(16, b"."), None, bytes(16), owner), slot)
        return name.ljust(16, b".")

    bs = [put(n, "b") for n in (b"b0", b"b1")]
    as_ = [put(n, "a") for n in (b"a0", b"a1", b"a2", b"a3", b"a4", b"a5")]
    t.pin(t.slot_of(as_[0]))
    slots, evicted, _ = t.reserve(4)
    assert evicted == as_[1:5] and len(slots) == 4  # a0 pinned: skipped
    assert t.entries_by_tenant() == {"b": 2, "a": 2}
    t.release(slots)
    _, evicted, _ = t.reserve(5)  # 4 free; one more: a tie, the first tenant in order
    assert len(evicted) == 1 and evicted[0] in (bs[0], as_[5])
    solo = tier(3)
    for n in (b"x", b"y", b"z"):
        (slot,), _, _ = solo.reserve(1)
        solo.insert(EvictedBlock(0, n.ljust(16, b"."), None, bytes(16), "only"), slot)
    assert solo.reserve(1)[1] == [b"x".ljust(16, b".")]


def test_a_largest_holder_whose_entries_are_all_pinned_lets_the_next_one_give():
    """"a" holds 5 entries, all pinned (being read); "b" holds 3; "c" stores 2: b gives
    (before, eviction stopped at a and c got nothing), down to one fewer than c would hold
    (on a tie the holder with entries gives)."""
    t = tier(8)

    def put(name: bytes, owner: str) -> int:
        (slot,), _, _ = t.reserve(1)
        t.insert(EvictedBlock(0, name.ljust(16, b"."), None, bytes(16), owner), slot)
        return slot

    for n in range(5):
        t.pin(put(b"a%d" % n, "a"))
    for n in range(3):
        put(b"b%d" % n, "b")
    slots, evicted, _ = t.reserve(2, incoming={"c": 2})
    assert len(slots) == 2 and [h[:2] for h in evicted] == [b"b0", b"b1"]
    assert t.entries_by_tenant() == {"a": 5, "b": 1}


def test_a_batch_larger_than_the_tier_does_not_push_out_a_smaller_tenant():
    """The host tier holds 2 blocks of tenant "a"; tenant "b" stores a batch of 6 into 4
    slots: b takes the 2 free slots and evicts nothing of a's (a holds less than b would);
    the rest of b's batch is not stored."""
    t = tier(4)
    for n in (b"a0", b"a1"):
        (slot,), _, _ = t.reserve(1)
        t.insert(EvictedBlock(0, n.ljust(16, b"."), None, bytes(16), "a"), slot)
    slots, evicted, _ = t.reserve(6, incoming={"b": 6})
    assert len(slots) == 2 and evicted == []
    assert t.entries_by_tenant() == {"a": 2}
