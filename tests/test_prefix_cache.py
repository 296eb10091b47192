import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.cache_store.hashing import Namespace, hash_block
from kvmesh.cache_store.prefix_cache import PrefixCache, PrefixMatch

BS = 16
ROOT = Namespace("test-model").root_hash()


def weak_hash(parent: bytes, block_token_bytes: bytes) -> bytes:
    """Deliberately terrible: depends only on the block's first token."""
    return b"\0" * 12 + block_token_bytes[:4]


def make(num_blocks=10, hash_fn=hash_block):
    events = []
    cache = PrefixCache(num_blocks, BS, event_sink=events.append, hash_fn=hash_fn)
    return cache, events


def run_request(cache, tokens, root=ROOT):
    """Match, lock, allocate, commit all full blocks; returns (bh, ids, hit) with ids held."""
    bh = cache.hash_blocks(tokens, root)
    hit = cache.match(bh)
    cache.lock(hit.block_ids)
    need = -(-len(tokens) // BS) - len(hit.block_ids)
    new = cache.allocate(need)
    assert new is not None
    ids = hit.block_ids + new
    cache.commit(bh, ids, len(hit.block_ids), len(bh.hashes))
    cache.check_integrity()
    return bh, ids, hit


def toks(seed, n):
    return [(seed * 1000 + i) % 50000 for i in range(n)]


def test_first_request_commits_and_frees_tail_first():
    cache, events = make()
    prompt = toks(1, 40)  # 2 full blocks + 8-token tail
    bh, ids, hit = run_request(cache, prompt)
    assert hit == PrefixMatch([], 0)
    assert ids == [0, 1, 2]
    assert events == [BlockStored(bh.hashes, None, prompt[:32], BS, "device")]
    assert cache.stats() == {"num_blocks": 10, "free": 7, "evictable": 0, "in_use": 3, "cached": 2}
    cache.unlock(ids)
    assert cache.pool.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert cache.stats() == {"num_blocks": 10, "free": 10, "evictable": 2, "in_use": 0, "cached": 2}
    cache.check_integrity()


def test_second_request_hits_prefix_and_stores_only_new_blocks():
    cache, events = make()
    a = toks(1, 40)
    bh_a, ids_a, _ = run_request(cache, a)
    cache.unlock(ids_a)
    b = a[:32] + toks(2, 20)  # shares 2 blocks, then 20 new tokens
    bh_b, ids_b, hit = run_request(cache, b)
    assert hit == PrefixMatch([0, 1], 32)
    assert ids_b == [0, 1, 3, 4]  # 3 and 4 come off the head of the free queue
    assert bh_b.hashes[:2] == bh_a.hashes[:2]
    assert events[-1] == BlockStored([bh_b.hashes[2]], bh_b.hashes[1], b[32:48], BS, "device")
    assert cache.pool.ref_cnt(0) == 1
    cache.unlock(ids_b)
    # B freed tail-first: 4, 3 (new leaf), 1, 0 -> cached child 3 precedes parent 1
    assert cache.pool.free_queue() == [5, 6, 7, 8, 9, 2, 4, 3, 1, 0]
    cache.check_integrity()


def test_eviction_takes_lru_leaves_first_and_reports_them():
    cache, events = make()
    a = toks(1, 48)  # 3 full blocks, ids 0..2
    bh_a, ids_a, _ = run_request(cache, a)
    cache.unlock(ids_a)
    b = toks(2, 32)  # 2 blocks, ids 3..4
    bh_b, ids_b, _ = run_request(cache, b)
    cache.unlock(ids_b)
    assert cache.pool.free_queue() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    events.clear()
    got = cache.allocate(7)
    assert got == [5, 6, 7, 8, 9, 2, 1]
    assert events == [BlockRemoved([bh_a.hashes[2], bh_a.hashes[1]], "device")]
    assert cache.match(bh_a) == PrefixMatch([0], 16)
    assert cache.match(bh_b) == PrefixMatch([3, 4], 32)
    cache.check_integrity()
    assert cache.allocate(4) is None  # only 3 left
    assert cache.can_allocate(3) and not cache.can_allocate(4)
    assert cache.allocate(3) == [0, 4, 3]
    assert events[-1] == BlockRemoved([bh_a.hashes[0], bh_b.hashes[1], bh_b.hashes[0]], "device")
    assert cache.stats()["cached"] == 0
    assert cache.num_orphan_evictions == 0
    cache.check_integrity()


def test_locked_prefix_survives_allocation_pressure():
    cache, events = make()
    a = toks(1, 32)
    bh, ids, _ = run_request(cache, a)
    cache.unlock(ids)
    hit = cache.match(bh)
    cache.lock(hit.block_ids)
    assert cache.allocate(9) is None
    assert cache.allocate(8) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert cache.match(bh).block_ids == [0, 1]
    cache.check_integrity()


def test_match_and_can_allocate_do_not_mutate():
    cache, _ = make()
    bh, ids, _ = run_request(cache, toks(1, 32))
    cache.unlock(ids)
    before = (cache.pool.free_queue(), cache.stats())
    for _ in range(3):
        cache.match(bh)
        cache.can_allocate(5)
        cache.can_allocate(50)
    assert (cache.pool.free_queue(), cache.stats()) == before


def test_concurrent_identical_prompts_cache_once():
    cache, events = make()
    p = toks(1, 32)
    bh = cache.hash_blocks(p, ROOT)
    a = cache.allocate(2)
    b = cache.allocate(2)
    assert cache.commit(bh, a, 0, 2) == 2
    n_events = len(events)
    assert cache.commit(bh, b, 0, 2) == 0  # same hashes already cached as a's blocks
    assert len(events) == n_events
    assert cache.pool.get_hash(b[0]) is None
    cache.unlock(b)
    cache.unlock(a)
    assert cache.stats()["cached"] == 2 and cache.stats()["evictable"] == 2
    assert cache.match(bh).block_ids == a
    cache.check_integrity()


def test_commit_stops_at_block_cached_by_another_sequence():
    cache, events = make()
    p = toks(1, 64)
    bh = cache.hash_blocks(p, ROOT)
    a = cache.allocate(4)
    cache.commit(bh, a, 0, 1)  # A caches block 0
    b = cache.allocate(4)
    # B's block 0 duplicates A's: B caches nothing, not even blocks 1..2,
    # which would otherwise hang below a block B does not hold
    assert cache.commit(bh, b, 0, 3) == 0
    assert all(cache.pool.get_hash(x) is None for x in b)
    cache.commit(bh, a, 1, 2)  # A caches block 1
    # B's block 1 is not its own cached block -> B's 2..3 stay uncached
    assert cache.commit(bh, b, 2, 4) == 0
    assert all(cache.pool.get_hash(x) is None for x in b)
    assert cache.match(bh).block_ids == a[:2]
    cache.unlock(a)  # A's blocks are now evictable, B's are held
    cache.check_integrity()
    assert cache.allocate(2) is not None
    cache.check_integrity()
    cache.unlock(b)
    cache.check_integrity()
    assert cache.num_orphan_evictions == 0


def test_incremental_commits_during_decode():
    cache, events = make()
    prompt = toks(3, 20)
    bh = cache.hash_blocks(prompt, ROOT)
    ids = cache.allocate(2)
    assert cache.commit(bh, ids, 0, 1) == 1
    out = prompt + toks(4, 30)  # generated tokens fill blocks 1, 2
    bh2 = cache.hash_blocks(out, ROOT)
    assert bh2.hashes[0] == bh.hashes[0]
    ids += cache.allocate(2)
    assert cache.commit(bh2, ids, 1, 2) == 1
    assert cache.commit(bh2, ids, 1, 3) == 1  # block 1 already ours: only 2 is new
    assert events[-1] == BlockStored([bh2.hashes[2]], bh2.hashes[1], out[32:48], BS, "device")
    assert cache.match(bh2).block_ids == ids[:3]
    cache.unlock(ids)
    cache.check_integrity()


def test_commit_validation():
    cache, _ = make()
    bh = cache.hash_blocks(toks(1, 48), ROOT)
    ids = cache.allocate(3)
    with pytest.raises(ValueError):
        cache.commit(bh, ids, 0, 4)
    with pytest.raises(ValueError):
        cache.commit(bh, ids[:2], 0, 3)
    with pytest.raises(ValueError):
        cache.commit(bh, [ids[0], ids[0], ids[1]], 0, 3)
    with pytest.raises(ValueError):
        cache.commit(bh, [ids[0], ids[1], 9], 0, 3)  # 9 is not held
    other = PrefixCache(10, 8)
    with pytest.raises(ValueError):
        other.match(bh)
    assert cache.stats()["cached"] == 0
    assert cache.commit(bh, ids, 2, 2) == 0
    cache.check_integrity()


def test_namespace_isolation():
    cache, _ = make()
    p = toks(1, 32)
    bh_a, ids, _ = run_request(cache, p, Namespace("test-model", cache_salt="tenant-a").root_hash())
    cache.unlock(ids)
    bh_b = cache.hash_blocks(p, Namespace("test-model", cache_salt="tenant-b").root_hash())
    assert set(bh_a.hashes).isdisjoint(bh_b.hashes)
    assert cache.match(bh_b) == PrefixMatch([], 0)
    assert cache.match(bh_a).num_cached_tokens == 32


def test_weak_hash_first_block_collision_does_not_match():
    cache, _ = make(hash_fn=weak_hash)
    s1 = [5] * 16 + [8] * 16
    s2 = [5] + [6] * 31  # same first token -> same weak hash for block 0
    bh1, ids1, _ = run_request(cache, s1)
    cache.unlock(ids1)
    bh2 = cache.hash_blocks(s2, ROOT)
    assert bh2.hashes[0] == bh1.hashes[0]
    assert cache.match(bh2) == PrefixMatch([], 0)
    _, ids2, hit = run_request(cache, s2)
    assert hit.block_ids == []
    assert all(cache.pool.get_hash(x) is None for x in ids2)  # collision: left uncached
    cache.unlock(ids2)
    assert cache.match(bh1).block_ids == ids1
    cache.check_integrity()


def test_weak_hash_collision_in_later_block_and_across_parents():
    cache, _ = make(num_blocks=12, hash_fn=weak_hash)
    s1 = [1] * 16 + [2] * 16
    s2 = [1] * 16 + [2] + [3] * 15  # true hit on block 0, block 1 collides
    s3 = [7] * 16 + [2] * 16  # block 1 identical to s1's but other parent; weak hash equal
    bh1, ids1, _ = run_request(cache, s1)
    cache.unlock(ids1)
    bh2 = cache.hash_blocks(s2, ROOT)
    assert bh2.hashes == bh1.hashes
    assert cache.match(bh2).block_ids == ids1[:1]
    bh3 = cache.hash_blocks(s3, ROOT)
    assert bh3.hashes[1] == bh1.hashes[1]
    _, ids3, hit3 = run_request(cache, s3)
    assert hit3.block_ids == []
    assert cache.pool.get_hash(ids3[1]) is None  # could not be cached under its own parent
    cache.unlock(ids3)
    assert cache.match(bh3).block_ids == [ids3[0]]
    assert cache.match(bh1).block_ids == ids1
    cache.check_integrity()


def test_clear_uncaches_everything():
    cache, events = make()
    bh_a, ids_a, _ = run_request(cache, toks(1, 32))
    cache.unlock(ids_a)
    bh_b, ids_b, _ = run_request(cache, toks(2, 48))  # still held
    assert cache.clear() == 5
    assert events[-1] == AllBlocksCleared()
    assert cache.stats() == {"num_blocks": 10, "free": 7, "evictable": 0, "in_use": 3, "cached": 0}
    assert cache.match(bh_a).block_ids == [] and cache.match(bh_b).block_ids == []
    cache.check_integrity()
    # the held sequence keeps going but caches nothing below its lost prefix
    assert cache.commit(bh_b, ids_b, 3, 3) == 0
    bh_b2 = cache.hash_blocks(toks(2, 64), ROOT)
    ids_b += cache.allocate(1)
    assert cache.commit(bh_b2, ids_b, 3, 4) == 0
    cache.unlock(ids_b)
    cache.check_integrity()


def test_check_integrity_detects_mismatch():
    cache, _ = make()
    bh, ids, _ = run_request(cache, toks(1, 32))
    cache.pool.clear_hash(ids[1])
    with pytest.raises(RuntimeError):
        cache.check_integrity()


def test_bad_constructor_args():
    with pytest.raises(ValueError):
        PrefixCache(10, 0)
    with pytest.raises(ValueError):
        PrefixCache(10, 16, medium="gpu")


def test_events_carry_medium():
    events = []
    cache = PrefixCache(4, BS, event_sink=events.append, medium="host")
    bh = cache.hash_blocks(toks(1, 16), ROOT)
    ids = cache.allocate(1)
    cache.commit(bh, ids, 0, 1)
    cache.unlock(ids)
    cache.allocate(4)
    assert [e.medium for e in events] == ["host", "host"]
    assert isinstance(events[1], BlockRemoved)


# -- property: random request workloads ------------------------------------------------

# Prompts drawn from a small family so that prefixes are shared: each is a
# concatenation of 16-token "pieces"; the weak hash makes pieces starting with
# the same token collide.
PIECES = [[p] * 8 + [p + 1] * 8 for p in range(4)] + [[0] * 8 + [9] * 8, [1] * 16]


class Driver:
    """Runs requests against a PrefixCache while tracking what each block truly holds."""

    def __init__(self, cache, ranks: list[int] | None = None):
        self.cache = cache
        self.truth: dict[int, tuple] = {}  # block id -> full token prefix its KV was computed for
        self.live: list[dict] = []
        self.evicted_log: list = []
        self.ranks = ranks  # block id -> loss rank (the cache's row_rank), or None

    def snapshot(self):
        c = self.cache
        return {
            h: (bid, c.pool.ref_cnt(bid), c.index.is_leaf(h), {ch for ch in c.index.node(h).children})
            for h, bid in c.index.items()
        }

    def start(self, tokens, rank: int = 0, exact: bool = False):
        """A request: reuses its cached prefix (with ``exact``, only up to the first lossy
        block) and computes the rest, which takes the lossiest rank of its context and
        ``rank``."""
        c = self.cache
        bh = c.hash_blocks(tokens, ROOT)
        hit = c.match(bh).block_ids
        for i, bid in enumerate(hit):
            # a hit must hand out exactly the KV of this prefix
            assert self.truth[bid] == tuple(tokens[: (i + 1) * BS])
        if self.ranks is not None and exact:
            hit = hit[:next((i for i, b in enumerate(hit) if self.ranks[b]), len(hit))]
        c.lock(hit)
        need = -(-len(tokens) // BS) - len(hit)
        snap = self.snapshot()
        before = len(self.evicted_log)
        held = {b for r in self.live for b in r["ids"]}
        new = c.allocate(need)
        if new is None:
            c.unlock(hit)
            return
        assert held.isdisjoint(new), "handed out a block a request holds"
        self.check_evictions(snap, self.evicted_log[before:])
        for k, bid in enumerate(new):
            i = len(hit) + k
            self.truth[bid] = tuple(tokens[: (i + 1) * BS])
            if self.ranks is not None:
                self.ranks[bid] = 0 if exact else max([rank] + [self.ranks[b] for b in hit])
        ids = hit + new
        self.live.append({"tokens": list(tokens), "ids": ids, "committed": len(hit)})
        return

    def check_evictions(self, snap, evicted_hashes):
        gone = set()
        for h in evicted_hashes:
            bid, ref, _, children = snap[h]
            assert ref == 0, "evicted a held block"
            assert children <= gone, "evicted a parent before its children"
            gone.add(h)

    def commit(self, r, upto):
        c = self.cache
        bh = c.hash_blocks(r["tokens"], ROOT)
        end = min(upto, len(bh.hashes))
        if end > r["committed"]:
            c.commit(bh, r["ids"], r["committed"], end)
            r["committed"] = end

    def finish(self, r):
        self.cache.unlock(r["ids"])
        self.live.remove(r)


ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["start"] * 3 + ["commit"] * 2 + ["finish"] * 3 + ["clear"]),
        st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=3),
        st.integers(0, 8),
        st.integers(0, 20),
    ),
    min_size=10,
    max_size=50,
)


@pytest.mark.parametrize("ranked", [False, True], ids=["exact", "lossy-copies"])
@pytest.mark.parametrize("hash_fn", [hash_block, weak_hash], ids=["xxh3", "weak"])
@settings(max_examples=120, deadline=None)
@given(ops=ops_strategy)
def test_random_workloads_keep_invariants(hash_fn, ranked, ops):
    """With ``ranked``, blocks have loss ranks and some requests reuse only exact blocks and
    compute the rest exactly, so their copies replace lossy cached ones (`PrefixCache.commit`)."""
    d = None
    events = []

    def sink(ev):
        events.append(ev)
        if isinstance(ev, BlockRemoved):
            d.evicted_log.extend(ev.block_hashes)

    ranks = [0] * 10 if ranked else None
    cache = PrefixCache(10, BS, event_sink=sink, hash_fn=hash_fn, row_rank=ranks.__getitem__ if ranked else None)
    d = Driver(cache, ranks)
    for op, pieces, pick, extra in ops:
        if op == "start":
            tokens = [t for p in pieces for t in PIECES[p]] + list(range(100, 100 + extra))
            d.start(tokens, rank=pick % 3, exact=ranked and extra % 2 == 0)
        elif op == "commit" and d.live:
            r = d.live[pick % len(d.live)]
            d.commit(r, (pick % 5) + 1)
        elif op == "finish" and d.live:
            r = d.live[pick % len(d.live)]
            d.commit(r, 99)
            d.finish(r)
        elif op == "clear":
            cache.clear()
        cache.check_integrity()
        held = sum(len(r["ids"]) for r in d.live)
        assert cache.stats()["in_use"] <= held
    for r in list(d.live):
        d.finish(r)
    cache.check_integrity()
    assert cache.stats()["in_use"] == 0
    assert cache.num_orphan_evictions == 0
    # the event stream replays to exactly the cached set
    replay: set[bytes] = set()
    for ev in events:
        if isinstance(ev, BlockStored):
            assert replay.isdisjoint(ev.block_hashes)
            replay.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= replay
            replay.difference_update(ev.block_hashes)
        else:
            replay.clear()
    assert replay == {h for h, _ in cache.index.items()}


def make_ranked(num_blocks=16):
    """A cache whose blocks have loss ranks (``ranks[block_id]``, 0 exact), as a worker's
    device pool has with lossy tiers."""
    events, ranks = [], [0] * num_blocks
    cache = PrefixCache(num_blocks, BS, event_sink=events.append, row_rank=ranks.__getitem__)
    return cache, events, ranks


def test_an_exact_copy_replaces_a_lossy_one():
    """Blocks cached as lossy copies (loaded from a lossy tier) are replaced by a later
    sequence's exact copies of the same blocks: the hashes stay cached, now by the exact
    blocks; the lossy blocks become empty; children of a replaced block not held by anyone stay
    cached below the new one; equal or lossier copies never replace."""
    cache, events, ranks = make_ranked()
    p = toks(1, 64)
    bh = cache.hash_blocks(p, ROOT)
    lossy = cache.allocate(4)
    for b in lossy:
        ranks[b] = 2
    assert cache.commit(bh, lossy, 0, 4) == 4
    cache.unlock(lossy)
    # a sibling branch below block 1, not held: stays cached below the new block 1
    q = p[:32] + toks(2, 16)
    bq = cache.hash_blocks(q, ROOT)
    hit = cache.match(bq).block_ids
    cache.lock(hit)
    [side] = cache.allocate(1)
    ranks[side] = 2
    assert cache.commit(bq, hit + [side], 2, 3) == 1
    cache.unlock(hit + [side])
    cache.check_integrity()
    # as lossy as the cached copies: nothing changes
    same = cache.allocate(4)
    for b in same:
        ranks[b] = 2
    n = len(events)
    assert cache.commit(bh, same, 0, 4) == 0 and len(events) == n
    cache.unlock(same)
    # exact: takes their place
    exact = cache.allocate(4)
    assert cache.commit(bh, exact, 0, 4) == 4
    assert len(events) == n  # the hashes stayed cached: nothing to report
    assert cache.match(bh).block_ids == exact and cache.num_replaced == 4
    assert all(cache.pool.get_hash(b) is None for b in lossy)
    assert cache.match(bq).block_ids == exact[:2] + [side]
    cache.check_integrity()
    cache.unlock(exact)
    cache.check_integrity()
    # lossier copies never replace exact ones; the replaced blocks, empty now, are handed
    # out first
    worse = cache.allocate(4)
    assert worse == lossy[::-1]
    for b in worse:
        ranks[b] = 1
    assert cache.commit(bh, worse, 0, 4) == 0
    cache.unlock(worse)
    assert cache.match(bh).block_ids == exact
    cache.check_integrity()
    assert cache.num_orphan_evictions == 0


def test_replacing_a_lossy_copy_in_use_keeps_its_holder_safe():
    """A request still runs on lossy copies when an exact sequence replaces them: its blocks
    keep their KV and their references (nothing is freed under it); its cached blocks below
    the replaced one are uncached (reported in one BlockRemoved) instead of staying below a
    block it does not hold; its later commits cache nothing; and once both let go the pool
    and index are consistent, with no orphan evictions."""
    cache, events, ranks = make_ranked()
    p = toks(1, 64)
    bh = cache.hash_blocks(p, ROOT)
    held = cache.allocate(4)  # the running request, on lossy copies
    for b in held:
        ranks[b] = 2
    assert cache.commit(bh, held, 0, 3) == 3
    exact = cache.allocate(4)
    n = len(events)
    assert cache.commit(bh, exact, 0, 4) == 4
    assert events[n:] == [BlockRemoved(bh.hashes[1:3], "device"),
                          BlockStored(bh.hashes[1:4], bh.hashes[0], p[16:64], BS, "device")]
    assert cache.match(bh).block_ids == exact
    assert all(cache.pool.ref_cnt(b) == 1 and cache.pool.get_hash(b) is None for b in held)
    cache.check_integrity()
    assert cache.commit(bh, held, 3, 4) == 0  # its chain is no longer cached
    cache.unlock(exact)
    cache.check_integrity()
    cache.allocate(cache.pool.num_free_blocks)  # pressure: evicts whatever is not held
    cache.check_integrity()
    assert all(cache.pool.ref_cnt(b) == 1 for b in held)
    cache.unlock(held)
    cache.check_integrity()
    assert cache.num_orphan_evictions == 0


def test_replacement_checks_the_chain():
    """A copy replaces only the node of its own chain: not one cached under another parent,
    nor one whose token bytes differ (a hash collision)."""
    cache, events, ranks = make_ranked()
    p = toks(1, 32)
    bh = cache.hash_blocks(p, ROOT)
    lossy = cache.allocate(2)
    for b in lossy:
        ranks[b] = 2
    cache.commit(bh, lossy, 0, 2)
    cache.unlock(lossy)
    node = cache.index.node(bh.hashes[0])
    exact = cache.allocate(2)
    assert not cache._better_copy(node, cache.index.node(bh.hashes[1]), exact[0], bh, 0)  # wrong parent
    other = cache.hash_blocks(toks(5, 32), ROOT)

    class Forged:  # block 0's hash with other tokens
        hashes = [bh.hashes[0]]
        block_size = BS
        token_bytes = other.token_bytes
        block_tokens = other.block_tokens
    assert cache.commit(Forged, exact, 0, 1) == 0
    assert cache.match(bh).block_ids == lossy
    assert cache.commit(bh, exact, 0, 2) == 2 and cache.match(bh).block_ids == exact
    cache.unlock(exact)
    cache.check_integrity()
