"""services.shortlist: the few workers kv_aware needs to see in a large fleet."""
from __future__ import annotations

import random

from kvmesh.cache_store.events import BlockStored, EventBatch
from kvmesh.services.cluster_index import ClusterIndex
from kvmesh.services.policies import RoutedShare
from kvmesh.services.shortlist import shortlist


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fleet(n: int):
    idx = ClusterIndex()
    ids = [f"w{i:04d}" for i in range(n)]
    for w in ids:  # every worker holds the shared first block
        idx.apply_batch(EventBatch(w, 1, 0.0, [BlockStored([H(0)], None, [], 1)]))
    share = RoutedShare()
    share.set_fleet(n)
    for w in ids:
        share.track(w)
    return idx, share, ids


def test_small_fleets_get_every_worker_with_its_match():
    idx, share, ids = fleet(6)
    out = shortlist(idx, share, [H(0), H(1)], 0.0, ids, random.Random(0))
    assert list(out) == ids and all(m.num_blocks == 1 for m in out.values())


def test_large_fleets_get_deep_holders_least_routed_and_a_sample():
    idx, share, ids = fleet(1000)
    # three workers hold a conversation of 5 blocks, one of them only its first 3
    for w, depth in (("w0007", 5), ("w0500", 5), ("w0900", 3)):
        idx.apply_batch(EventBatch(w, 2, 0.0, [BlockStored([H(i) for i in range(1, depth)], H(0), [], 1)]))
    for w in ids[:990]:
        share.note(w)  # ten workers were never sent anything
    out = shortlist(idx, share, [H(i) for i in range(6)], 0.0, ids, random.Random(1), holders=8, least=4, sample=4)
    assert len(out) <= 16
    assert out["w0007"].num_blocks == 5 and out["w0500"].num_blocks == 5 and out["w0900"].num_blocks == 3
    assert list(out) == sorted(out)  # in id order, whatever the sets hold
    never = set(ids[990:])
    assert len(never & set(out)) >= 4        # the least routed are there
    for w, m in out.items():                 # every match is exact; all hold the shared block
        assert m is not None and m.num_blocks == {"w0007": 5, "w0500": 5, "w0900": 3}.get(w, 1)
    # departed workers are dropped
    out = shortlist(idx, share, [H(i) for i in range(6)], 0.0, ids, random.Random(1),
                    live_set=set(ids) - {"w0007"})
    assert "w0007" not in out and out["w0500"].num_blocks == 5
