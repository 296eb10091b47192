import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.block_pool import Block, BlockPool, allocate_kv_cache, kv_bytes_per_block


def h(i: int) -> bytes:
    return bytes([i]) * 16


# -- KV tensor ---------------------------------------------------------------------


def test_allocate_kv_cache_shape_and_layout():
    kv = allocate_kv_cache(5, 3, 2, 16, 8, torch.float16, "cpu")
    assert kv.shape == (5, 3, 2, 2, 16, 8)
    assert kv.dtype == torch.float16 and kv.is_contiguous()
    assert torch.count_nonzero(kv) == 0
    per_block = 3 * 2 * 2 * 16 * 8 * 2  # layers * (K, V) * heads * tokens * head_dim * fp16 bytes
    assert kv_bytes_per_block(3, 2, 16, 8, torch.float16) == per_block == 3072
    assert kv[1].is_contiguous() and kv[1].numel() * kv.element_size() == per_block
    # block b starts exactly b * per_block bytes into the storage
    assert (kv[4].data_ptr() - kv.data_ptr()) == 4 * per_block
    assert kv_bytes_per_block(1, 1, 1, 1, torch.float32) == 8


def test_kv_cache_rejects_bad_dims():
    with pytest.raises(ValueError):
        allocate_kv_cache(0, 1, 1, 1, 1, torch.float32, "cpu")
    with pytest.raises(ValueError):
        kv_bytes_per_block(1, 1, -16, 1, torch.float32)


# -- scenarios on a 10-block pool -----------------------------------------------------


def test_fresh_pool():
    p = BlockPool(10)
    assert p.num_blocks == 10
    assert p.free_queue() == list(range(10))
    assert (p.num_free_blocks, p.num_evictable_blocks, p.num_in_use_blocks) == (10, 0, 0)
    assert p.usage() == 0.0
    p.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_pops_head_and_free_appends_tail():
    p = BlockPool(10)
    assert p.get_new_blocks(3) == [0, 1, 2]
    assert [p.ref_cnt(i) for i in range(4)] == [1, 1, 1, 0]
    assert p.num_in_use_blocks == 3 and p.usage() == pytest.approx(0.3)
    p.free(reversed([0, 1, 2]))
    assert p.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert p.get_new_blocks(0) == []
    assert p.get_new_blocks(8) == [3, 4, 5, 6, 7, 8, 9, 2]
    p.check_integrity()


def test_not_enough_blocks_returns_none_and_changes_nothing():
    evicted = []
    p = BlockPool(4, on_evict=lambda b, hh: evicted.append(b))
    ids = p.get_new_blocks(2)
    p.set_hash(ids[0], h(1))
    p.free([ids[0]])
    before = (p.free_queue(), p.num_free_blocks, p.num_evictable_blocks)
    assert p.get_new_blocks(4) is None
    assert (p.free_queue(), p.num_free_blocks, p.num_evictable_blocks) == before
    assert evicted == [] and p.get_hash(ids[0]) == h(1)
    with pytest.raises(ValueError):
        p.get_new_blocks(-1)


def test_eviction_order_and_callback():
    evicted = []
    p = BlockPool(10, on_evict=lambda b, hh: evicted.append((b, hh, p.get_hash(b))))
    a = p.get_new_blocks(3)  # [0, 1, 2]
    for i, b in enumerate(a):
        p.set_hash(b, h(10 + i))
    b2 = p.get_new_blocks(2)  # [3, 4]
    p.set_hash(3, h(20))
    p.free(reversed(a))  # queue: 5..9, 2, 1, 0
    p.free(reversed(b2))  # queue: 5..9, 2, 1, 0, 4, 3
    assert p.free_queue() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert p.num_evictable_blocks == 4
    got = p.get_new_blocks(8)
    assert got == [5, 6, 7, 8, 9, 4, 2, 1]  # the empty block 4 before any eviction
    # callback sees the hash before it is cleared
    assert evicted == [(2, h(12), h(12)), (1, h(11), h(11))]
    assert all(p.get_hash(b) is None for b in got)
    assert p.num_evictable_blocks == 2 and p.free_queue() == [0, 3]
    p.check_integrity()


def test_touch_locks_cached_blocks():
    p = BlockPool(10)
    ids = p.get_new_blocks(2)
    p.set_hash(0, h(1))
    p.set_hash(1, h(2))
    p.free(reversed(ids))
    assert p.num_evictable_blocks == 2
    p.touch([0, 1])
    assert p.ref_cnt(0) == 1 and p.num_evictable_blocks == 0
    assert 0 not in p.free_queue() and 1 not in p.free_queue()
    assert p.get_new_blocks(9) is None
    p.touch([0])  # second holder
    p.free([0])
    assert p.ref_cnt(0) == 1 and 0 not in p.free_queue()
    p.free([1, 0])
    assert p.free_queue()[-2:] == [1, 0]
    p.check_integrity()


def test_touch_empty_block_rejected_atomically():
    p = BlockPool(10)
    ids = p.get_new_blocks(1)
    p.set_hash(ids[0], h(1))
    p.free(ids)
    with pytest.raises(ValueError):
        p.touch([0, 5])  # 5 is empty
    assert p.ref_cnt(0) == 0 and 0 in p.free_queue()
    with pytest.raises(IndexError):
        p.touch([10])
    with pytest.raises(IndexError):
        p.touch([-1])


def test_double_free_rejected_atomically():
    p = BlockPool(10)
    p.get_new_blocks(2)
    with pytest.raises(ValueError):
        p.free([0, 1, 1])
    assert p.ref_cnt(0) == 1 and p.ref_cnt(1) == 1
    with pytest.raises(ValueError):
        p.free([5])
    p.touch([0])
    p.free([0, 0])
    assert p.ref_cnt(0) == 0
    p.check_integrity()


def test_set_hash_rules():
    p = BlockPool(10)
    with pytest.raises(ValueError):
        p.set_hash(0, h(1))  # not held
    p.get_new_blocks(1)
    p.set_hash(0, h(1))
    with pytest.raises(ValueError):
        p.set_hash(0, h(2))
    with pytest.raises(TypeError):
        p.set_hash(1, "abc")  # type: ignore[arg-type]
    assert p.get_hash(0) == h(1)
    with pytest.raises(IndexError):
        p.get_hash(10)


def test_clear_hash_moves_free_block_to_head():
    p = BlockPool(10)
    ids = p.get_new_blocks(3)
    for b in ids:
        p.set_hash(b, h(b))
    p.free(reversed(ids))
    assert p.clear_hash(1) == h(1)
    assert p.clear_hash(1) is None
    assert p.free_queue()[0] == 1
    assert p.num_evictable_blocks == 2
    ids2 = p.get_new_blocks(1)
    assert ids2 == [1]
    p.set_hash(1, h(7))
    assert p.clear_hash(1) == h(7) and p.ref_cnt(1) == 1
    p.check_integrity()


def test_reset():
    p = BlockPool(10)
    ids = p.get_new_blocks(3)
    p.set_hash(0, h(0))
    p.set_hash(2, h(2))
    with pytest.raises(RuntimeError):
        p.reset()
    p.free(reversed(ids))
    assert sorted(p.reset()) == [0, 2]
    assert p.num_evictable_blocks == 0 and all(p.get_hash(i) is None for i in range(10))
    p.check_integrity()


def test_check_integrity_detects_corruption():
    p = BlockPool(10)
    p.get_new_blocks(2)
    p._blocks[1].ref_cnt = 0  # held block with ref 0, not queued
    with pytest.raises(RuntimeError, match="not queued"):
        p.check_integrity()
    q = BlockPool(10)
    q.free(q.get_new_blocks(10))  # every block made and queued
    blk = q._blocks[4]
    blk.prev.next = blk.next  # unlink without bookkeeping
    blk.next.prev = blk.prev
    with pytest.raises(RuntimeError):
        q.check_integrity()
    r = BlockPool(10)
    r._num_evictable = 3
    with pytest.raises(RuntimeError, match="num_evictable"):
        r.check_integrity()


def test_a_huge_pool_costs_memory_only_for_the_blocks_used():
    import tracemalloc

    tracemalloc.start()
    p = BlockPool(10**12)  # far more blocks than memory could hold as objects
    ids = p.get_new_blocks(1000)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 2_000_000
    assert ids == list(range(1000))  # handed out in id order, as from a fully built queue
    assert p.num_free_blocks == 10**12 - 1000 and p.num_in_use_blocks == 1000
    for i in ids[:3]:
        p.set_hash(i, h(i))
    p.free(reversed(ids))
    # never-used blocks come before freed ones; freed blocks keep their LRU order behind them
    assert p.get_new_blocks(2) == [1000, 1001]
    assert p.get_hash(10**12 - 1) is None and p.ref_cnt(10**12 - 1) == 0
    with pytest.raises(ValueError):
        p.touch([10**12 - 1])  # never used: empty
    with pytest.raises(ValueError):
        p.free([10**12 - 1])
    small = BlockPool(3)
    assert small.get_new_blocks(3) == [0, 1, 2] and small.get_new_blocks(1) is None
    small.free([2, 1, 0])
    assert small.free_queue() == [2, 1, 0]
    small.check_integrity()
    assert BlockPool(4).free_queue() == [0, 1, 2, 3]


def test_block_has_slots():
    b = Block(3)
    assert not hasattr(b, "__dict__")
    assert "prev" not in repr(b)


# -- model-based property test ------------------------------------------------------


class ModelPool:
    """Reference: plain lists, O(n) everything; an allocation takes the queue's first empty
    block, else its head."""

    def __init__(self, n):
        self.ref = [0] * n
        self.hash = [None] * n
        self.queue = list(range(n))
        self.evicted = []

    def get(self, k):
        if k > len(self.queue):
            return None
        out = []
        for _ in range(k):  # the first empty block, else the queue head
            b = next((c for c in self.queue if self.hash[c] is None), self.queue[0])
            self.queue.remove(b)
            out.append(b)
        for b in out:
            self.ref[b] = 1
            if self.hash[b] is not None:
                self.evicted.append((b, self.hash[b]))
                self.hash[b] = None
        return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("gtfsc"), st.integers(0, 11), st.integers(0, 255)), max_size=60))
def test_pool_matches_reference_model(ops):
    n = 10
    evicted = []
    p = BlockPool(n, on_evict=lambda b, hh: evicted.append((b, hh)))
    m = ModelPool(n)
    for op, x, y in ops:
        if op == "g":
            k = x % 5
            assert p.get_new_blocks(k) == m.get(k)
        elif op == "t":
            b = x % n
            if m.ref[b] == 0 and m.hash[b] is None:
                with pytest.raises(ValueError):
                    p.touch([b])
            else:
                p.touch([b])
                if m.ref[b] == 0:
                    m.queue.remove(b)
                m.ref[b] += 1
        elif op == "f":
            b = x % n
            if m.ref[b] == 0:
                with pytest.raises(ValueError):
                    p.free([b])
            else:
                p.free([b])
                m.ref[b] -= 1
                if m.ref[b] == 0:
                    m.queue.append(b)
        elif op == "s":
            b = x % n
            if m.ref[b] > 0 and m.hash[b] is None:
                p.set_hash(b, h(y))
                m.hash[b] = h(y)
            else:
                with pytest.raises(ValueError):
                    p.set_hash(b, h(y))
        elif op == "c":
            b = x % n
            assert p.clear_hash(b) == m.hash[b]
            if m.hash[b] is not None and m.ref[b] == 0:
                m.queue.remove(b)
                m.queue.insert(0, b)
            m.hash[b] = None
        p.check_integrity()
        assert p.free_queue() == m.queue
        assert [p.ref_cnt(i) for i in range(n)] == m.ref
        assert [p.get_hash(i) for i in range(n)] == m.hash
        assert evicted == m.evicted
        assert p.num_free_blocks == m.ref.count(0)
        assert p.num_evictable_blocks == sum(1 for i in range(n) if m.ref[i] == 0 and m.hash[i] is not None)
        assert p.num_in_use_blocks == n - m.ref.count(0)


# -- owners: max-min fair eviction --------------------------------------------------


def test_the_owner_holding_most_is_evicted_first():
    """Tenant "a" caches 6 blocks, "b" 2, b's freed first (older): a new allocation evicts
    a's least recently used blocks, not b's, until a holds no more than b; then LRU."""
    p = BlockPool(8)
    ids = p.get_new_blocks(8)
    for i, bid in enumerate(ids):
        p.set_hash(bid, h(i), "b" if i < 2 else "a")
    p.free(ids)  # b's blocks (0, 1) are the queue head: plain LRU would evict them first
    assert p.blocks_by_owner() == {"a": 6, "b": 2}
    assert p.get_new_blocks(4) == [2, 3, 4, 5]  # a's oldest four: a now holds 2, as many as b
    p.check_integrity()
    assert p.blocks_by_owner() == {"a": 2, "b": 2, None: 4}  # the four taken are in use, for nobody
    assert p.get_new_blocks(1) == [0]  # a tie: the queue head (b's oldest), plain LRU
    assert p.get_new_blocks(1) == [6]  # a holds more again
    p.check_integrity()


class OwnerModelPool(ModelPool):
    """Reference with owners (a block in use counts as its allocator's, None here; a cached
    one as its owner's): the queue's first empty block; else, while several owners hold
    blocks, the queue's first cached block of the owner holding the most blocks (ties: the
    queue head's owner); with one owner, the queue head."""

    def __init__(self, n):
        super().__init__(n)
        self.owner = [None] * n

    def held(self, o):  # in use or cached
        return sum(1 for i, hh in enumerate(self.hash) if (hh is not None or self.ref[i]) and self.owner[i] == o)

    def get(self, k):
        if k > len(self.queue):
            return None
        out = []
        for _ in range(k):
            b = self.queue[0]
            owners = {self.owner[i] for i, hh in enumerate(self.hash) if hh is not None or self.ref[i]}
            if self.hash[b] is not None:
                empty = [c for c in self.queue if self.hash[c] is None]
                b = empty[0] if empty else (None if len(owners) > 1 else b)
            if b is None:
                b = self.queue[0]
                best = self.owner[b]
                for c in self.queue:
                    if self.hash[c] is not None and self.held(self.owner[c]) > self.held(best):
                        best = self.owner[c]
                b = next(c for c in self.queue if self.hash[c] is not None and self.owner[c] == best)
            self.queue.remove(b)
            self.ref[b] = 1
            if self.hash[b] is not None:
                self.evicted.append((b, self.hash[b]))
                self.hash[b] = None
                self.owner[b] = None
            out.append(b)
        return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("gtfsc"), st.integers(0, 11), st.integers(0, 255)), max_size=60))
def test_pool_with_owners_matches_reference_model(ops):
    n = 10
    evicted = []
    p = BlockPool(n, on_evict=lambda b, hh: evicted.append((b, hh)))
    m = OwnerModelPool(n)
    for op, x, y in ops:
        b = x % n
        if op == "g":
            assert p.get_new_blocks(x % 5) == m.get(x % 5)
        elif op == "t" and not (m.ref[b] == 0 and m.hash[b] is None):
            p.touch([b])
            if m.ref[b] == 0:
                m.queue.remove(b)
            m.ref[b] += 1
        elif op == "f" and m.ref[b] > 0:
            p.free([b])
            m.ref[b] -= 1
            if m.ref[b] == 0:
                m.queue.append(b)
                if m.hash[b] is None:
                    m.owner[b] = None
        elif op == "s" and m.ref[b] > 0 and m.hash[b] is None:
            owner = (None, "a", "b")[y % 3]
            p.set_hash(b, h(y), owner)
            m.hash[b], m.owner[b] = h(y), owner
        elif op == "c":
            assert p.clear_hash(b) == m.hash[b]
            if m.hash[b] is not None and m.ref[b] == 0:
                m.queue.remove(b)
                m.queue.insert(0, b)
            m.hash[b] = None
            if m.ref[b] == 0:  # a block still in use stays its owner's
                m.owner[b] = None
        p.check_integrity()
        assert p.free_queue() == m.queue
        assert [p.get_hash(i) for i in range(n)] == m.hash
        assert evicted == m.evicted
        assert p.blocks_by_owner() == {o: m.held(o) for o in (None, "a", "b") if m.held(o)}


def test_an_empty_block_is_used_before_a_cached_one_is_evicted():
    """One owner: a request's partial last block (never hashed) is freed after its cached
    blocks, so it sits behind them in the queue; allocating took the queue head and evicted
    a cached block while the empty one sat there (one hot prompt drained the cache a block
    per request)."""
    evicted = []
    p = BlockPool(4, on_evict=lambda b, hh: evicted.append(b))
    ids = p.get_new_blocks(2)
    for i, bid in enumerate(ids):
        p.set_hash(bid, h(i))
    p.free(ids[::-1])
    ids = p.get_new_blocks(2)  # the two never used
    p.set_hash(ids[0], h(7))
    p.free(ids[::-1])  # queue: cached, cached, empty, cached
    assert p.free_queue() == [1, 0, 3, 2]
    assert p.get_new_blocks(1) == [3] and evicted == []
    p.check_integrity()


# -- protected shares (set_protection, room_for) -------------------------------------


def cached_pool(owners: str, n: int | None = None) -> BlockPool:
    """A pool whose blocks ``i`` are cached for ``owners[i]`` (queue order = index order),
    plus ``n - len(owners)`` empty blocks."""
    p = BlockPool(n or len(owners))
    ids = p.get_new_blocks(len(owners))
    for i, bid in enumerate(ids):
        p.set_hash(bid, h(i), owners[i])
    p.free(ids)
    return p


def test_an_owner_at_the_floor_keeps_its_blocks_while_others_are_evictable():
    """b caches 3 blocks, a 1, and a's running requests hold 2 (6 blocks). Max-min alone:
    a's next block is b's (b holds the most evictable). With a floor of 3 (two tenants),
    b keeps its 3 and a's own cached block goes; ``room_for`` counts what a can take so."""
    def pool():
        p = cached_pool("bbba", 6)
        p.get_new_blocks(2, "a")  # the two never-used blocks: running, for a
        return p
    plain = pool()
    assert plain.blocks_by_owner() == {"a": 3, "b": 3}
    assert plain.get_new_blocks(1, "a") == [0]  # b's oldest
    p = pool()
    p.set_protection(3)
    assert p.room_for("a") == 1 and p.room_for("b") == 3
    assert p.get_new_blocks(1, "a") == [3]  # a's own
    assert p.blocks_by_owner() == {"a": 3, "b": 3}
    p.check_integrity()
    # nothing but b's blocks left: b at the floor still gives them up rather than fail
    assert p.room_for("a") == 0
    assert p.get_new_blocks(1, "a") == [0]
    p.check_integrity()


def test_idle_owners_blocks_go_first():
    p = cached_pool("cccbbbaa")
    p.set_protection(2, idle=["c"])
    assert p.room_for("a") == 3 + 2 + 1  # c's (idle), a's own, b's one over the floor
    assert p.get_new_blocks(3, "a") == [0, 1, 2]  # c's, though b holds as many and a's are there
    p.set_protection(None)
    assert p.room_for("a") == p.num_free_blocks
    with pytest.raises(ValueError):
        p.set_protection(-1)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 6), st.booleans()), max_size=40),
       st.integers(0, 6), st.sampled_from(["", "c"]))
def test_an_allocation_within_room_keeps_every_active_owner_at_its_floor(ops, floor, idle):
    """Random allocations (some freed and cached again) by three owners with a floor: one of
    at most ``room_for`` blocks never takes an active owner under min(its blocks, floor)."""
    p = BlockPool(16)
    p.set_protection(floor, idle=idle)
    step = 0
    for owner, k, keep in ops:
        before = p.blocks_by_owner()
        room = p.room_for(owner)
        got = p.get_new_blocks(k, owner)
        if got is None:
            assert k > p.num_free_blocks
            continue
        after = p.blocks_by_owner()
        if k <= room:
            for o, held in before.items():
                if o != owner and o not in idle:
                    assert after.get(o, 0) >= min(held, floor), (o, before, after, room)
        for bid in got:  # cache them (or drop them) so that later allocations can evict them
            step += 1
            p.set_hash(bid, h(step % 256), owner)
        if not keep:
            p.free(got)
        p.check_integrity()
