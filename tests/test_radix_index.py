import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.hashing import hash_blocks
from kvmesh.cache_store.radix_index import MatchResult, RadixIndex, RadixNode

ROOT = bytes(16)


def seq(tokens, bs=4):
    return hash_blocks(tokens, bs, ROOT)


def tok(*ids):
    return struct.pack(f"<{len(ids)}I", *ids)


def test_insert_and_match_full_and_partial():
    a = seq(list(range(16)))  # 4 blocks
    idx = RadixIndex()
    assert idx.insert(a.hashes, a.block_tokens, ["a0", "a1", "a2", "a3"]) == [0, 1, 2, 3]
    assert len(idx) == 4 and a.hashes[2] in idx and idx.get(a.hashes[2]) == "a2"
    r = idx.match(a.hashes, a.block_tokens)
    assert isinstance(r, MatchResult) and r == (["a0", "a1", "a2", "a3"], 4)
    b = seq(list(range(8)) + [99] * 8)  # shares 2 blocks
    assert idx.match(b.hashes, b.block_tokens) == (["a0", "a1"], 2)
    assert idx.match(b.hashes, None) == (["a0", "a1"], 2)
    assert idx.match([], None) == ([], 0)
    # list-of-bytes token source
    toks = [a.block_tokens(i) for i in range(4)]
    assert idx.match(a.hashes, toks).num_blocks == 4
    idx.check_integrity()


def test_match_stops_at_token_mismatch():
    a = seq(list(range(16)))
    idx = RadixIndex()
    idx.insert(a.hashes, a.block_tokens, [0, 1, 2, 3])
    lying = [a.block_tokens(0), a.block_tokens(1), tok(7, 7, 7, 7), a.block_tokens(3)]
    assert idx.match(a.hashes, lying).num_blocks == 2
    assert idx.match(a.hashes, lambda i: lying[i]).num_blocks == 2


def test_match_requires_parent_chain():
    idx = RadixIndex()
    x, y, z = b"x" * 16, b"y" * 16, b"z" * 16
    idx.insert([x, y], None, ["x", "y"])
    idx.insert([z], None, ["z"])
    # y is cached, but under x, not under z
    assert idx.match([z, y], None) == (["z"], 1)
    assert idx.match([y], None) == ([], 0)


def test_insert_below_existing_chain():
    a = seq(list(range(24)))  # 6 blocks
    idx = RadixIndex()
    idx.insert(a.hashes, a.block_tokens, list("abcdef"), 0, 2)
    assert len(idx) == 2
    assert idx.insert(a.hashes, a.block_tokens, list("abcdef"), start=2) == [2, 3, 4, 5]
    assert idx.match(a.hashes, a.block_tokens).values == list("abcdef")
    b = seq(list(range(100, 124)))
    with pytest.raises(ValueError):
        idx.insert(b.hashes, b.block_tokens, list("uvwxyz"), start=2)
    with pytest.raises(ValueError):
        idx.insert(a.hashes, a.block_tokens, ["too", "few"])
    with pytest.raises(ValueError):
        idx.insert(a.hashes, a.block_tokens, list("abcdef"), start=4, end=3)
    # chain present but the caller's tokens differ -> not a chain of this sequence
    lying = lambda i: tok(9, 9, 9, 9) if i == 0 else a.block_tokens(i)  # noqa: E731
    with pytest.raises(ValueError):
        idx.insert(a.hashes, lying, list("abcdef"), start=2)


def test_reinsert_keeps_existing_values():
    a = seq(list(range(8)))
    idx = RadixIndex()
    idx.insert(a.hashes, a.block_tokens, [1, 2])
    assert idx.insert(a.hashes, a.block_tokens, [8, 9]) == []
    assert idx.match(a.hashes, a.block_tokens).values == [1, 2]


def test_collision_same_parent_different_tokens_not_overwritten():
    idx = RadixIndex()
    hh = [b"c" * 16, b"d" * 16]
    idx.insert(hh, [tok(1, 2, 3, 4), tok(5, 6, 7, 8)], ["first0", "first1"])
    other = [tok(1, 2, 3, 4), tok(5, 6, 7, 0)]  # same hashes, block 1 differs
    assert idx.insert(hh, other, ["second0", "second1"]) == []
    assert idx.get(hh[1]) == "first1"
    assert idx.match(hh, other) == (["first0"], 1)
    idx.check_integrity()


def test_collision_with_hash_under_other_parent_stops_insert():
    idx = RadixIndex()
    p, q, c, d = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    idx.insert([p, c], None, ["p", "c"])
    # second sequence: q, then a block whose hash equals c (lives under p), then d
    assert idx.insert([q, c, d], None, ["q", "c2", "d"]) == [0]
    assert idx.get(c) == "c" and d not in idx
    assert idx.match([q, c, d], None).values == ["q"]


def test_node_without_tokens_never_passes_token_check():
    idx = RadixIndex()
    idx.insert([b"a" * 16], None, ["v"])
    assert idx.match([b"a" * 16], None).num_blocks == 1
    assert idx.match([b"a" * 16], [tok(1)]).num_blocks == 0


def test_extend():
    a = seq(list(range(24)))
    idx = RadixIndex()
    assert idx.extend(a.hashes, a.block_tokens, list(range(6)), 0, 3) == [0, 1, 2]
    assert idx.extend(a.hashes, a.block_tokens, list(range(6)), 3) == [3, 4, 5]
    assert idx.match(a.hashes, a.block_tokens).num_blocks == 6
    b = seq(list(range(50, 74)))
    with pytest.raises(ValueError):
        idx.extend(b.hashes, b.block_tokens, list(range(6)), 2)
    # hash exists but at another depth
    with pytest.raises(ValueError):
        idx.extend([b.hashes[0], a.hashes[0]], None, [0, 0], 2)


def test_remove_leaf_and_subtree():
    a = seq(list(range(16)))
    b = seq(list(range(8)) + [5] * 8)
    idx = RadixIndex()
    idx.insert(a.hashes, a.block_tokens, ["a0", "a1", "a2", "a3"])
    idx.insert(b.hashes, b.block_tokens, ["b0", "b1", "b2", "b3"], start=2)
    assert len(idx) == 6
    assert idx.remove(a.hashes[3]) == ["a3"]
    assert idx.remove(a.hashes[3]) == []
    removed = idx.remove(a.hashes[1])
    assert removed[0] == "a1" and sorted(removed[1:]) == ["a2", "b2", "b3"]
    assert len(idx) == 1 and idx.is_leaf(a.hashes[0])
    assert idx.match(b.hashes, b.block_tokens).values == ["a0"]
    idx.check_integrity()
    idx.clear()
    assert len(idx) == 0 and idx.match(a.hashes, None).num_blocks == 0
    idx.check_integrity()


def test_lru_leaf_eviction_order():
    a = seq([1] * 12)  # 3 blocks
    b = seq([2] * 8)
    c = seq([1] * 4 + [3] * 4)  # shares block 0 with a
    idx = RadixIndex()
    idx.insert(a.hashes, a.block_tokens, ["a0", "a1", "a2"])
    idx.insert(b.hashes, b.block_tokens, ["b0", "b1"])
    idx.insert(c.hashes, c.block_tokens, ["a0", "c1"], start=1)
    idx.touch(a.hashes)  # a chain becomes most recent
    # leaves by recency: b1 (oldest), c1, a2
    assert idx.evict_lru_leaf() == "b1"
    assert idx.evict_lru_leaf() == "b0"  # b0 became a leaf, older than c1
    assert idx.evict_lru_leaf(lambda v: v != "c1") == "a2"
    assert idx.evict_lru_leaf() == "c1"
    assert idx.pop_lru_leaf() == (a.hashes[1], "a1")
    assert idx.evict_lru_leaf(lambda v: False) is None
    assert len(idx) == 1
    assert idx.evict_lru_leaf() == "a0"
    assert idx.evict_lru_leaf() is None
    idx.check_integrity()


def test_node_has_slots():
    idx = RadixIndex()
    idx.insert([b"a" * 16], None, [1])
    n = idx.node(b"a" * 16)
    assert isinstance(n, RadixNode) and not hasattr(n, "__dict__")
    assert n.depth == 1 and n.parent is not None and n.parent.block_hash is None


# -- property: LRU against a brute-force model ----------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("itre"), st.lists(st.integers(0, 2), min_size=1, max_size=4), st.booleans()),
        max_size=40,
    )
)
def test_lru_against_brute_force(ops):
    """Chains over a 3-letter alphabet; the model recomputes the LRU leaf by scanning."""
    idx = RadixIndex()
    clock = 0
    model: dict[tuple, int] = {}  # prefix path -> last access tick
    payload = lambda path: "/".join(map(str, path))  # noqa: E731

    def hashes(path):
        return hash_blocks(list(path), 1, ROOT).hashes

    for op, path, flag in ops:
        path = tuple(path)
        hs = hashes(path)
        if op == "i":
            vals = [payload(path[: k + 1]) for k in range(len(path))]
            got = idx.insert(hs, None, vals)
            exp = [k for k in range(len(path)) if path[: k + 1] not in model]
            assert got == exp
            for k in exp:
                clock += 1
                model[path[: k + 1]] = clock
        elif op == "t":
            idx.touch(hs)
            for k in range(len(path)):
                if path[: k + 1] in model:
                    clock += 1
                    model[path[: k + 1]] = clock
        elif op == "r":
            removed = idx.remove(hs[-1])
            gone = [q for q in model if q[: len(path)] == path]
            assert sorted(removed) == sorted(payload(q) for q in gone)
            for q in gone:
                del model[q]
        else:
            allowed = (lambda v: len(v) % 2 == 1) if flag else (lambda v: True)
            leaves = [
                q for q in model if not any(len(o) == len(q) + 1 and o[: len(q)] == q for o in model)
            ]
            cands = [q for q in leaves if allowed(payload(q))]
            got = idx.evict_lru_leaf(allowed)
            if not cands:
                assert got is None
            else:
                victim = min(cands, key=model.__getitem__)
                assert got == payload(victim)
                del model[victim]
        assert len(idx) == len(model)
        m = idx.match(hs, None)
        exp_n = next((k for k in range(len(path)) if path[: k + 1] not in model), len(path))
        assert m.num_blocks == exp_n
    idx.check_integrity()
