"""Shortlists: the few workers a policy needs to see, so routing cost does not grow with the fleet.

Building a `services.policies.WorkerView` for every live worker costs O(workers) per
request; at 1,000 workers that is most of a routing decision. A policy that sets
``uses_shortlist = True`` (``kv_aware``) is content with a shortlist:

* the workers holding the longest leading runs of the request's blocks
  (`ClusterIndex.match_deepest`, at most ``holders`` of them): where the cache hits are;
* the ``least`` workers with the smallest recent routed share (`RoutedShare.least`): where
  the share cap and the share term of ``kv_aware`` push new work;
* ``sample`` workers drawn uniformly at random: fresh load information from the rest of
  the fleet, in the spirit of power-of-d choices (Mitzenmacher 2001).

The mean routed share of the whole fleet comes from `RoutedShare.total` and goes to the
policy as `RouteRequest.routed_mean`, so the share cap means the same as with every
worker in view. Cost per request: O(matched blocks + holders + least x log(workers) +
sample).
"""
from __future__ import annotations

import random
from typing import Container, Sequence

from kvmesh.services.cluster_index import ClusterIndex, PrefixMatch
from kvmesh.services.policies import RoutedShare

__all__ = ["SHORTLIST_HOLDERS", "SHORTLIST_LEAST", "SHORTLIST_SAMPLE", "shortlist"]

#: Deepest prefix holders on a shortlist (workers).
SHORTLIST_HOLDERS = 8
#: Least-routed workers on a shortlist (workers).
SHORTLIST_LEAST = 4
#: Random workers on a shortlist (workers).
SHORTLIST_SAMPLE = 4


def shortlist(index: ClusterIndex, routed: RoutedShare, block_hashes: Sequence[bytes], now: float,
              worker_ids: Sequence[str], rng: random.Random, holders: int = SHORTLIST_HOLDERS,
              least: int = SHORTLIST_LEAST, sample: int = SHORTLIST_SAMPLE,
              live_set: Container[str] | None = None) -> dict[str, PrefixMatch | None]:
    """The workers to show a policy for one request, with their prefix matches.

    Args:
        index: the cluster's block index.
        routed: the router's decayed routed counts; every worker in ``worker_ids`` should
            have been passed to `RoutedShare.track` so that idle ones can be found.
        block_hashes: the request's chained block hashes.
        now: the index's clock (seconds).
        worker_ids: the live workers (every id returned is one of them).
        rng: source of the random sample.
        holders, least, sample: how many of each kind (workers, >= 0).
        live_set: membership test for ``worker_ids`` (a set or dict), to drop workers the
            index or the routed counts still know but that have left (or that the caller
            excludes, as a retry does its tried workers); they never take a holder's place.
            None: all are live.

    Returns:
        ``{worker_id: PrefixMatch or None}`` (None: no matching block), in worker id
        order; all live workers when the fleet is no larger than the shortlist. The
        result depends only on the arguments and ``rng``'s state, never on set order.
    """
    if len(worker_ids) <= holders + least + sample:
        matches = index.match(block_hashes, now) if block_hashes else {}
        return {w: matches.get(w) for w in worker_ids}
    live = worker_ids if isinstance(worker_ids, (list, tuple)) else list(worker_ids)
    others: dict[str, None] = {}
    for w in routed.least(least):
        others[w] = None
    for w in rng.sample(live, min(sample, len(live))):
        others[w] = None
    ok = live_set if live_set is not None else _ALL
    found = index.match_deepest(block_hashes, now, holders, also=others, rng=rng,
                                allowed=live_set) if block_hashes else {}
    out: dict[str, PrefixMatch | None] = {w: m for w, m in found.items() if w in ok}
    for w in others:
        if w in ok and w not in out:
            out[w] = None
    return {w: out[w] for w in sorted(out)}


class _All:
    def __contains__(self, item) -> bool:
        return True


_ALL = _All()
