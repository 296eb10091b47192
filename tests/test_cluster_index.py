"""ClusterIndex: event application, ordering, media, speculation and prefix matching."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cache_store.events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.services.cluster_index import TIER_WEIGHTS, ClusterIndex, PrefixMatch, weighted_blocks


def H(i: int) -> bytes:
    """A 16-byte stand-in block hash."""
    return i.to_bytes(16, "big")


def stored(ids, medium="device", parent=None) -> BlockStored:
    hashes = [H(i) for i in ids]
    return BlockStored(hashes, parent, [0] * len(hashes), 1, medium)


def removed(ids, medium="device") -> BlockRemoved:
    return BlockRemoved([H(i) for i in ids], medium)


def batch(worker, seq, *events) -> EventBatch:
    return EventBatch(worker, seq, 0.0, list(events))


def counts(result: dict[str, PrefixMatch]) -> dict[str, int]:
    return {w: m.num_blocks for w, m in result.items()}


# ------------------------------------------------------------------ sequencing
def test_unknown_worker_must_start_at_seq_1():
    idx = ClusterIndex()
    assert idx.apply_batch(batch("a", 2, stored([1]))) is False
    assert idx.workers() == [] and idx.last_seq("a") is None and idx.num_blocks() == 0
    assert idx.apply_batch(batch("a", 1, stored([1]))) is True
    assert idx.last_seq("a") == 1 and idx.num_blocks("a") == 1


def test_gap_applies_nothing_and_keeps_last_seq():
    idx = ClusterIndex()
    assert idx.apply_batch(batch("a", 1, stored([1, 2])))
    assert idx.apply_batch(batch("a", 3, stored([3]), AllBlocksCleared())) is False
    assert idx.last_seq("a") == 1
    assert set(idx.worker_blocks("a")) == {H(1), H(2)}
    assert idx.apply_batch(batch("a", 2, stored([3])))
    assert idx.last_seq("a") == 2 and idx.num_blocks("a") == 3


def test_duplicates_are_ignored():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1])))
    idx.apply_batch(batch("a", 2, stored([2])))
    assert idx.apply_batch(batch("a", 1, AllBlocksCleared())) is True
    assert idx.apply_batch(batch("a", 2, removed([1, 2]))) is True
    assert idx.last_seq("a") == 2 and idx.num_blocks("a") == 2


def test_invalid_event_raises_and_applies_nothing():
    idx = ClusterIndex()
    with pytest.raises(ValueError):
        idx.apply_batch(batch("a", 1, stored([1]), "not an event"))
    with pytest.raises(ValueError):
        idx.apply_batch(batch("a", 1, stored([1]), BlockRemoved([H(1)], "tape")))
    assert idx.workers() == [] and idx.num_blocks() == 0


def test_all_blocks_cleared_only_touches_its_worker_and_later_events_apply():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2, 3])))
    idx.apply_batch(batch("b", 1, stored([1, 2])))
    idx.apply_batch(batch("a", 2, AllBlocksCleared(), stored([7])))
    assert set(idx.worker_blocks("a")) == {H(7)}
    assert set(idx.worker_blocks("b")) == {H(1), H(2)}
    assert idx.holders(H(1)) == {"b": "device"}
    assert idx.num_blocks() == 3


def test_snapshot_replaces_entries_and_sets_seq():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2])))
    idx.apply_snapshot("a", 10, [(H(5), None, "device"), (H(6), H(5), "host"), (H(6), H(5), "device")])
    assert idx.worker_blocks("a") == {H(5): frozenset({"device"}), H(6): frozenset({"device", "host"})}
    assert idx.last_seq("a") == 10
    assert idx.apply_batch(batch("a", 9, AllBlocksCleared()))  # covered by the snapshot
    assert idx.num_blocks("a") == 2
    assert idx.apply_batch(batch("a", 12, stored([8]))) is False
    assert idx.apply_batch(batch("a", 11, removed([5])))
    assert set(idx.worker_blocks("a")) == {H(6)}
    with pytest.raises(ValueError):
        idx.apply_snapshot("a", 20, [(H(1), None, "floppy")])
    assert idx.last_seq("a") == 11 and set(idx.worker_blocks("a")) == {H(6)}


def test_remove_worker():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2])))
    idx.apply_batch(batch("b", 1, stored([1])))
    idx.add_speculative("a", [H(9)], now=0.0)
    idx.remove_worker("a")
    idx.remove_worker("nobody")
    assert idx.workers() == ["b"] and idx.last_seq("a") is None
    assert idx.num_blocks() == 1 and idx.num_speculative(now=0.0) == 0
    assert counts(idx.match([H(1), H(2)], now=0.0)) == {"b": 1}


# ---------------------------------------------------------------------- media
def test_block_moves_device_to_host():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2])))
    # Offloaded to host: both copies exist, the device one is the one reported.
    idx.apply_batch(batch("a", 2, stored([1, 2], medium="host", parent=None)))
    m = idx.match([H(1), H(2)], now=0.0)["a"]
    assert m == PrefixMatch(2, {"device": 2})
    # Device copy of block 2 evicted: it is still on the host.
    idx.apply_batch(batch("a", 3, removed([2], "device")))
    m = idx.match([H(1), H(2)], now=0.0)["a"]
    assert m == PrefixMatch(2, {"device": 1, "host": 1})
    assert idx.holders(H(2)) == {"a": "host"}
    # Removing a medium the block is not on changes nothing.
    idx.apply_batch(batch("a", 4, removed([2], "disk")))
    assert idx.worker_blocks("a")[H(2)] == frozenset({"host"})
    # Host copy gone too: the block is gone, and the match stops before it.
    idx.apply_batch(batch("a", 5, removed([2], "host")))
    assert H(2) not in idx.worker_blocks("a")
    assert idx.match([H(1), H(2)], now=0.0)["a"] == PrefixMatch(1, {"device": 1})


def test_weighted_blocks_uses_tier_weights():
    m = PrefixMatch(6, {"device": 2, "host": 3, "disk": 1})
    assert weighted_blocks(m) == pytest.approx(2 * 1.0 + 3 * 0.8 + 1 * 0.5)
    assert weighted_blocks(PrefixMatch()) == 0.0
    assert set(TIER_WEIGHTS) == set(MEDIUMS)
    assert all(0.0 <= TIER_WEIGHTS[m] <= TIER_WEIGHTS["device"] == 1.0 for m in MEDIUMS)


# ---------------------------------------------------------------------- match
def test_match_counts_leading_consecutive_blocks_only():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2, 4])))      # hole at 3
    idx.apply_batch(batch("b", 1, stored([2, 3, 4])))      # lacks the first block
    idx.apply_batch(batch("c", 1, stored([1, 2, 3, 4, 5])))
    idx.apply_batch(batch("d", 1, stored([99])))
    req = [H(1), H(2), H(3), H(4)]
    assert counts(idx.match(req, now=0.0)) == {"a": 2, "b": 0, "c": 4, "d": 0}
    assert counts(idx.match([], now=0.0)) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert counts(idx.match([H(50), H(1)], now=0.0)) == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_speculative_entries_count_as_device_until_they_expire():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1])))
    idx.add_speculative("a", [H(1), H(2), H(3)], now=10.0, ttl_s=2.0)
    idx.add_speculative("b", [H(1), H(2)], now=10.0, ttl_s=2.0)
    m = idx.match([H(1), H(2), H(3), H(4)], now=11.0)
    assert m["a"] == PrefixMatch(3, {"device": 3})
    assert m["b"] == PrefixMatch(2, {"device": 2})
    assert idx.num_blocks("a") == 1  # speculation is not a real entry
    assert idx.num_speculative(now=11.0) == 5
    m = idx.match([H(1), H(2), H(3)], now=12.5)
    assert counts(m) == {"a": 1}  # b was known only by speculation
    assert idx.num_speculative(now=12.5) == 0


def test_speculative_refresh_extends_and_real_events_supersede():
    idx = ClusterIndex()
    idx.add_speculative("a", [H(1), H(2)], now=0.0, ttl_s=1.0)
    idx.add_speculative("a", [H(1)], now=0.5, ttl_s=1.0)   # block 1 now lives until 1.5
    assert counts(idx.match([H(1), H(2)], now=1.2)) == {"a": 1}
    # The real event says block 1 went to host: that wins over the device guess.
    idx.add_speculative("a", [H(1), H(2)], now=2.0, ttl_s=5.0)
    idx.apply_batch(batch("a", 1, stored([1], medium="host")))
    assert idx.match([H(1), H(2)], now=3.0)["a"] == PrefixMatch(2, {"host": 1, "device": 1})
    assert idx.num_speculative(now=3.0) == 1


def test_match_reports_media_per_worker():
    idx = ClusterIndex()
    idx.apply_batch(batch("a", 1, stored([1, 2, 3], "host"), stored([4, 5], "disk")))
    idx.apply_batch(batch("b", 1, stored([1, 2, 3, 4, 5, 6])))
    idx.apply_batch(batch("c", 1, stored([1], "peer"), stored([2, 3], "remote")))
    m = idx.match([H(i) for i in range(1, 8)], now=0.0)
    assert m["a"] == PrefixMatch(5, {"host": 3, "disk": 2})
    assert m["b"] == PrefixMatch(6, {"device": 6})
    assert m["c"] == PrefixMatch(3, {"peer": 1, "remote": 2})


# ----------------------------------------------------------------- properties
WORKERS = ["w0", "w1", "w2"]
HASH_IDS = st.integers(0, 11)
EVENT = st.one_of(
    st.builds(lambda ids, m: ("store", ids, m), st.lists(HASH_IDS, min_size=1, max_size=5), st.sampled_from(MEDIUMS)),
    st.builds(lambda ids, m: ("remove", ids, m), st.lists(HASH_IDS, min_size=1, max_size=5), st.sampled_from(MEDIUMS)),
    st.just(("clear",)),
)
STEP = st.tuples(st.sampled_from(WORKERS), st.lists(EVENT, max_size=4), st.booleans())


def _to_event(e):
    if e[0] == "store":
        return stored(e[1], e[2])
    if e[0] == "remove":
        return removed(e[1], e[2])
    return AllBlocksCleared()


def _model_match(model, worker, req):
    n = 0
    for h in req:
        if model[worker].get(h):
            n += 1
        else:
            break
    return n


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(STEP, max_size=30), req=st.lists(HASH_IDS, max_size=8))
def test_applying_batches_matches_a_model_dict(steps, req):
    idx = ClusterIndex()
    model: dict[str, dict[bytes, set[str]]] = {w: {} for w in WORKERS}
    seqs = {w: 0 for w in WORKERS}
    sent: list[EventBatch] = []
    for worker, events, replay in steps:
        seqs[worker] += 1
        b = batch(worker, seqs[worker], *[_to_event(e) for e in events])
        assert idx.apply_batch(b)
        sent.append(b)
        if replay:  # an old batch delivered again must change nothing
            assert idx.apply_batch(sent[len(sent) // 2])
        # skipping one must be refused
        assert not idx.apply_batch(batch(worker, seqs[worker] + 2, AllBlocksCleared()))
        state = model[worker]
        for e in events:
            if e[0] == "clear":
                state.clear()
            elif e[0] == "store":
                for i in e[1]:
                    state.setdefault(H(i), set()).add(e[2])
            else:
                for i in e[1]:
                    media = state.get(H(i))
                    if media is not None:
                        media.discard(e[2])
                        if not media:
                            del state[H(i)]
    for w in WORKERS:
        assert idx.worker_blocks(w) == {h: frozenset(m) for h, m in model[w].items()}
        assert idx.num_blocks(w) == len(model[w])
        assert idx.last_seq(w) == (seqs[w] or None)
    assert idx.num_blocks() == len(set().union(*(model[w].keys() for w in WORKERS)))
    hashes = [H(i) for i in req]
    result = idx.match(hashes, now=0.0)
    for w in idx.workers():
        expect = _model_match(model, w, hashes)
        got = result[w]
        assert got.num_blocks == expect
        assert sum(got.by_medium.values()) == expect
        # each matched block is reported on its fastest medium
        best = {}
        for h in hashes[:expect]:
            m = min(model[w][h], key=MEDIUMS.index)
            best[m] = best.get(m, 0) + 1
        assert got.by_medium == best


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(STEP, max_size=30), req=st.lists(HASH_IDS, max_size=8), limit=st.integers(0, 5),
       also=st.lists(st.sampled_from(WORKERS), max_size=3), spec=st.sampled_from(WORKERS))
def test_match_deepest_agrees_with_match_for_the_deepest_holders(steps, req, limit, also, spec):
    idx = ClusterIndex()
    seqs = {w: 0 for w in WORKERS}
    for worker, events, _ in steps:
        seqs[worker] += 1
        assert idx.apply_batch(batch(worker, seqs[worker], *[_to_event(e) for e in events]))
    hashes = [H(i) for i in req]
    idx.add_speculative(spec, hashes[:2], now=0.0, ttl_s=1.0)
    full = {w: m for w, m in idx.match(hashes, now=0.5).items() if m.num_blocks}
    got = idx.match_deepest(hashes, now=0.5, limit=limit, also=also)
    # every answer is exact (blocks and media) and only holders are returned
    for w, m in got.items():
        assert m == full[w], w
    # the deepest holders come first: the top `limit` depths are exactly the best ones
    depths = sorted((m.num_blocks for m in full.values()), reverse=True)
    top = [m.num_blocks for w, m in list(got.items())[:min(limit, len(full))]]
    assert top == depths[:min(limit, len(full))]
    # without an rng a partial level is cut at the smallest ids; with one, seeded draws repeat
    import random
    a = idx.match_deepest(hashes, now=0.5, limit=limit, rng=random.Random(3))
    assert a == idx.match_deepest(hashes, now=0.5, limit=limit, rng=random.Random(3))
    # every `also` worker with a match is there
    assert {w for w in also if w in full} <= set(got)


def test_reported_tier_weights_replace_the_defaults_within_bounds():
    from kvmesh.services.cluster_index import reported_tier_weights

    assert reported_tier_weights(None) is TIER_WEIGHTS and reported_tier_weights({}) is TIER_WEIGHTS
    got = reported_tier_weights({"host": 0.93, "disk": -0.4, "remote": 7, "device": 0.1, "peer": 0.9})
    assert got == {**TIER_WEIGHTS, "host": 0.93, "disk": 0.0, "remote": 1.0}  # device and peer not taken
    assert TIER_WEIGHTS["disk"] == 0.5  # the defaults are not changed
    for junk in ({"disk": "0.9"}, {"disk": True}, {"disk": float("nan")}, {"disk": 10 ** 400}, ["disk"], "disk"):
        assert reported_tier_weights(junk) is TIER_WEIGHTS, junk
    assert reported_tier_weights({"disk": 0.25}, {}) == {"disk": 0.25}  # reported only (router Status)
    m = PrefixMatch(num_blocks=4, by_medium={"device": 2, "disk": 2})
    assert weighted_blocks(m, reported_tier_weights({"disk": 0.0})) == 2.0


def test_router_credits_a_holder_by_the_weights_it_reported():
    """A worker whose disk measured slower than its prefill reports disk weight 0: the
    router's view credits its disk-held prefix with nothing (the worker would compute it),
    while a worker that reported nothing keeps the default credit."""
    from kvmesh.cache_store.hashing import Namespace, hash_blocks
    from kvmesh.services.router import RouterServicer

    bs = 16
    hashes = hash_blocks(list(range(1, 1 + 10 * bs)), bs, Namespace(model_id="m").root_hash()).hashes
    index = ClusterIndex()
    for w in ("slow_disk", "default"):
        index.apply_snapshot(w, 0, [(h, None, "disk") for h in hashes])
    live = {"slow_disk": {"address": "a:1", "load": {"tier_weights": {"disk": 0.0, "host": 0.9}}},
            "default": {"address": "b:1", "load": {}}}
    shown, _, _ = RouterServicer(index, subscriber=None, seed=0)._views(live, list(hashes), 0.0, set())
    views = {v.worker_id: v for v in shown}
    assert views["slow_disk"].matched_blocks == views["default"].matched_blocks == 10
    assert views["slow_disk"].weighted_blocks == 0.0
    assert views["default"].weighted_blocks == 10 * TIER_WEIGHTS["disk"]
