"""Cluster-wide view of which worker caches which KV block, on which medium.

A :class:`ClusterIndex` is fed the KV event batches every worker publishes
(:mod:`cache_store.events`) and answers one question for the router: for a
request's chained block hashes, how many *leading consecutive* blocks does each
worker already hold? Because block ``i``'s hash covers block ``i - 1``'s hash
(:mod:`cache_store.hashing`), holding hash ``i`` implies holding the whole
prefix up to it, so a prefix match is a walk over the request's hashes from
the start.

The index is a plain object: no I/O, no clock of its own (callers pass ``now``
in seconds, any monotonic origin) and no locking; use it from one thread or
event loop. The Redis side lives in :mod:`services.index_subscriber`.

Ordering and gaps: each worker numbers its batches ``1, 2, 3, ...``. The index
remembers the last sequence number it applied per worker and refuses a batch
that would skip one, so the caller can rebuild that worker's entries from a
snapshot (:meth:`ClusterIndex.apply_snapshot`) instead of drifting silently.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Container, Iterable, Mapping, Sequence

from kvmesh.cache_store.events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["TIER_WEIGHTS", "PrefixMatch", "ClusterIndex", "reported_tier_weights", "weighted_blocks"]

#: Credit of one matched block by the tier it is loaded from, as a fraction of
#: the cost of recomputing it. A block on the device saves its whole prefill
#: (1.0); a block elsewhere must first be copied in, and the weight is the
#: fraction of the recompute cost still saved after paying for that copy.
#: These are planning defaults, not measurements: the 0.8 for host memory
#: assumes a PCIe copy of a block takes about a fifth of its prefill time, 0.5
#: for local disk about half, 0.4 for a peer or remote store (network plus
#: serialization). Workers measure both and report ``weight = 1 - load_time /
#: recompute_time``, clipped to [0, 1], for their host, disk and remote tiers in
#: their load (`reported_tier_weights`); these defaults stand in until they have.
TIER_WEIGHTS: dict[str, float] = {"device": 1.0, "host": 0.8, "disk": 0.5, "peer": 0.4, "remote": 0.4}



def reported_tier_weights(reported: object, defaults: Mapping[str, float] = TIER_WEIGHTS) -> Mapping[str, float]:
    """``defaults`` with the lower tiers' weights a worker measured and reported in its load
    (``Load.tier_weights``, `workers.engine.Engine.tier_weights`) put in their place.

    Only "host", "disk" and "remote" are taken, each clipped to [0, 1]; anything else in
    ``reported`` (other media, non-numbers, NaN; a lease from an older worker has none) is
    ignored. Returns ``defaults`` itself when nothing is taken.
    """
    if not isinstance(reported, Mapping) or not reported:
        return defaults
    out = None
    for medium in ("host", "disk", "remote"):
        v = reported.get(medium)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        try:
            v = float(v)
        except OverflowError:  # an int past float's range
            continue
        if v == v:  # not NaN
            if out is None:
                out = dict(defaults)
            out[medium] = min(1.0, max(0.0, v))
    return defaults if out is None else out


_MEDIUM_INDEX = {m: i for i, m in enumerate(MEDIUMS)}
_DEVICE = _MEDIUM_INDEX["device"]
# Best (fastest) medium of a bit mask over MEDIUMS: the lowest set bit, as
# MEDIUMS is ordered fastest first.
_BEST = [0] + [(m & -m).bit_length() - 1 for m in range(1, 1 << len(MEDIUMS))]


@dataclass(slots=True)
class PrefixMatch:
    """How much of a request's prefix one worker holds.

    Attributes:
        num_blocks: leading consecutive blocks of the request held there (blocks).
        by_medium: the same blocks split by the fastest medium each is held on
            (blocks per medium name; media with no blocks are omitted).
    """

    num_blocks: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)


def weighted_blocks(match: PrefixMatch, weights: Mapping[str, float] = TIER_WEIGHTS) -> float:
    """Matched blocks credited by tier: ``sum(by_medium[m] * weights[m])`` (blocks).

    Each block counts for the fraction of its recompute cost saved after
    loading it from its tier (see :data:`TIER_WEIGHTS`); media missing from
    ``weights`` count 0.
    """
    return sum(n * weights.get(m, 0.0) for m, n in match.by_medium.items())


class _WorkerState:
    """Per-worker bookkeeping: last applied batch seq and the hashes held."""

    __slots__ = ("last_seq", "hashes")

    def __init__(self, last_seq: int):
        self.last_seq = last_seq
        self.hashes: set[bytes] = set()


class ClusterIndex:
    """Block hash -> {worker_id: media}, fed by per-worker KV event batches.

    A worker may hold one block on several media at once (a device copy and a
    host copy after offloading); the index keeps the set and reports the
    fastest one. Speculative entries (:meth:`add_speculative`) are kept apart
    and count as ``device`` while they live.

    Not thread-safe: use from a single thread or event loop.
    """

    def __init__(self) -> None:
        # hash -> {worker_id: bit mask over MEDIUMS}
        self._blocks: dict[bytes, dict[str, int]] = {}
        # hash -> {worker_id: index of best medium}, only where that is not device;
        # lets match() skip the per-worker medium lookup in the common case.
        self._offdev: dict[bytes, dict[str, int]] = {}
        self._workers: dict[str, _WorkerState] = {}
        # hash -> {worker_id: expiry}; heap of (expiry, tiebreak, worker_id, hashes) for purging
        self._spec: dict[bytes, dict[str, float]] = {}
        self._spec_heap: list[tuple[float, int, str, tuple[bytes, ...]]] = []
        self._spec_counter = itertools.count()

    # ------------------------------------------------------------------ events
    def apply_batch(self, batch: EventBatch) -> bool:
        """Apply one worker's event batch, events in order.

        Returns:
            True when applied, or ignored as a duplicate (``batch.seq`` at or
            below the worker's last applied seq). False, with nothing applied,
            when the batch would leave a gap: the worker is known and
            ``batch.seq != last_seq + 1``, or it is unknown and
            ``batch.seq != 1``. The caller should then rebuild the worker from
            a snapshot (:meth:`apply_snapshot`).

        Raises:
            ValueError: an event is not a KV event or names an unknown medium
                (checked before anything is applied).
        """
        wid = batch.worker_id
        state = self._workers.get(wid)
        last = state.last_seq if state is not None else 0
        if state is not None and batch.seq <= last:
            return True
        if batch.seq != last + 1:
            return False
        for ev in batch.events:
            if isinstance(ev, (BlockStored, BlockRemoved)):
                if ev.medium not in _MEDIUM_INDEX:
                    raise ValueError(f"unknown medium {ev.medium!r:.40}")
            elif not isinstance(ev, AllBlocksCleared):
                raise ValueError(f"not a KV event: {type(ev).__name__}")
        if state is None:
            state = self._workers[wid] = _WorkerState(0)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                bit = 1 << _MEDIUM_INDEX[ev.medium]
                for h in ev.block_hashes:
                    self._add(h, wid, bit, state)
            elif isinstance(ev, BlockRemoved):
                bit = 1 << _MEDIUM_INDEX[ev.medium]
                for h in ev.block_hashes:
                    self._remove(h, wid, bit, state)
            else:
                self._clear(wid, state)
        state.last_seq = batch.seq
        return True

    def apply_snapshot(self, worker_id: str, seq: int,
                       blocks: Iterable[tuple[bytes, bytes | None, str]]) -> None:
        """Replace everything known about ``worker_id`` with a snapshot.

        Args:
            worker_id: the worker.
            seq: last event batch seq the snapshot reflects; the next batch
                applied must be ``seq + 1`` (earlier ones are duplicates).
            blocks: ``(block_hash, parent_block_hash, medium)`` per cached
                block; the same hash may appear once per medium. The parent
                is not needed by this index and is ignored.

        Raises:
            ValueError: a medium is not one of ``MEDIUMS`` (nothing is changed).
        """
        entries: dict[bytes, int] = {}
        for h, _parent, medium in blocks:
            idx = _MEDIUM_INDEX.get(medium)
            if idx is None:
                raise ValueError(f"unknown medium {medium!r:.40}")
            entries[h] = entries.get(h, 0) | (1 << idx)
        state = self._workers.get(worker_id)
        if state is None:
            state = self._workers[worker_id] = _WorkerState(seq)
        else:
            self._clear(worker_id, state)
            state.last_seq = seq
        for h, mask in entries.items():
            self._add(h, worker_id, mask, state)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its entries, speculative entries and last seq. No-op if unknown."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._clear(worker_id, state)
        for h in [h for h, holders in self._spec.items() if worker_id in holders]:
            holders = self._spec[h]
            del holders[worker_id]
            if not holders:
                del self._spec[h]

    # --------------------------------------------------------------- queries
    def workers(self) -> list[str]:
        """Ids of the workers the index has state for, sorted."""
        return sorted(self._workers)

    def last_seq(self, worker_id: str) -> int | None:
        """Last batch seq applied for ``worker_id``; None if the worker is unknown."""
        state = self._workers.get(worker_id)
        return None if state is None else state.last_seq

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Distinct block hashes held (any medium, speculative excluded): by
        ``worker_id``, or in the whole cluster when None (blocks)."""
        if worker_id is None:
            return len(self._blocks)
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.hashes)

    def holders(self, block_hash: bytes) -> dict[str, str]:
        """Workers holding ``block_hash`` (real events only) -> fastest medium."""
        return {w: MEDIUMS[_BEST[m]] for w, m in self._blocks.get(block_hash, {}).items()}

    def common_depth(self, block_hashes: Sequence[bytes], min_holders: int) -> int:
        """Leading blocks of ``block_hashes`` that at least ``min_holders`` workers each hold
        from the first block on (real events only; any medium).

        What `policies.KVAwarePolicy` reads off the views as its widely-held depth, for callers
        that pass it only a shortlist of views (`RouteRequest.common_blocks`). Cost:
        O(depth x holders), by set intersection block by block.
        """
        if min_holders < 1:
            return len(block_hashes)
        alive: set[str] | None = None
        depth = 0
        for h in block_hashes:
            held = self._blocks.get(h)
            if not held:
                break
            alive = set(held) if alive is None else alive.intersection(held)
            if len(alive) < min_holders:
                break
            depth += 1
        return depth

    def worker_blocks(self, worker_id: str) -> dict[bytes, frozenset[str]]:
        """Every block hash ``worker_id`` holds -> the set of media it is on."""
        state = self._workers.get(worker_id)
        if state is None:
            return {}
        out = {}
        for h in state.hashes:
            mask = self._blocks[h][worker_id]
            out[h] = frozenset(m for i, m in enumerate(MEDIUMS) if mask >> i & 1)
        return out

    # ----------------------------------------------------------- speculation
    def add_speculative(self, worker_id: str, block_hashes: Sequence[bytes], now: float,
                        ttl_s: float = 2.0) -> None:
        """Record that ``worker_id`` is about to hold ``block_hashes``.

        The router calls this when it sends a request, so that a burst of
        requests with the same prefix finds it on that worker before the
        worker's real events arrive. Until ``now + ttl_s`` (seconds, on the
        caller's clock) :meth:`match` counts these blocks as held on
        ``device``; afterwards they are ignored and purged lazily. A worker's
        real entries take precedence wherever both exist.
        """
        if not block_hashes:
            return
        self._purge_speculative(now)
        expiry = now + ttl_s
        hashes = tuple(block_hashes)
        for h in hashes:
            holders = self._spec.get(h)
            if holders is None:
                self._spec[h] = {worker_id: expiry}
            elif holders.get(worker_id, -1.0) < expiry:
                holders[worker_id] = expiry
        heapq.heappush(self._spec_heap, (expiry, next(self._spec_counter), worker_id, hashes))

    def num_speculative(self, now: float) -> int:
        """Live (worker, block) speculative entries at ``now`` (after purging)."""
        self._purge_speculative(now)
        return sum(len(v) for v in self._spec.values())

    def _purge_speculative(self, now: float) -> None:
        heap = self._spec_heap
        spec = self._spec
        while heap and heap[0][0] <= now:
            expiry, _, wid, hashes = heapq.heappop(heap)
            for h in hashes:
                holders = spec.get(h)
                # Only drop it if no later add_speculative extended it.
                if holders is not None and holders.get(wid, float("inf")) <= expiry:
                    del holders[wid]
                    if not holders:
                        del spec[h]

    # ------------------------------------------------------------------ match
    def match(self, block_hashes: Sequence[bytes], now: float) -> dict[str, PrefixMatch]:
        """Leading consecutive blocks of a request that each worker holds.

        Args:
            block_hashes: the request's chained block hashes, first block first.
            now: current time on the clock used for :meth:`add_speculative` (seconds).

        Returns:
            ``{worker_id: PrefixMatch}`` for every worker the index has
            event state for (0 blocks where nothing matches), plus workers
            known only through speculative entries that match at least one
            block. A block counts for a worker if it
            holds it on any medium or has a live speculative entry for it
            (counted as ``device`` unless a real entry names the medium).

        Cost: O(matched blocks x workers), with the per-worker work of each
        step done by set intersection; the walk stops at the first block no
        remaining worker holds.
        """
        self._purge_speculative(now)
        result: dict[str, PrefixMatch] = {w: PrefixMatch() for w in self._workers}
        blocks = self._blocks
        spec = self._spec
        offdev = self._offdev
        # worker -> per-medium counts of matched blocks held off the device
        off_counts: dict[str, list[int]] = {}
        # Off-device media are tallied per run of consecutive blocks with an equal
        # offdev entry (usually a whole chain sits on one medium) and the same set
        # of matching workers, so the per-worker loop runs once per run, not per block.
        run_od: dict[str, int] | None = None
        run_len = 0
        alive: set[str] = set()
        i = 0
        for h in block_hashes:
            nxt = _still_holding(blocks.get(h), spec.get(h), alive, i == 0)
            if not nxt:
                break
            if i and len(nxt) != len(alive):
                self._tally(run_od, run_len, alive, off_counts)
                run_len = 0
                for w in alive.difference(nxt):
                    self._finish(result, w, i, off_counts)
            od = offdev.get(h)
            if od != run_od:
                self._tally(run_od, run_len, nxt, off_counts)
                run_od = od
                run_len = 0
            run_len += 1
            alive = nxt
            i += 1
        if i:
            self._tally(run_od, run_len, alive, off_counts)
            for w in alive:
                self._finish(result, w, i, off_counts)
        return result

    @staticmethod
    def _tally(od: dict[str, int] | None, n: int, alive: set[str], off_counts: dict[str, list[int]]) -> None:
        if od is None or not n:
            return
        for w, m in od.items():
            if w in alive:
                counts = off_counts.get(w)
                if counts is None:
                    counts = off_counts[w] = [0] * len(MEDIUMS)
                counts[m] += n

    @staticmethod
    def _finish(result: dict[str, PrefixMatch], w: str, n: int, off_counts: dict[str, list[int]]) -> None:
        by_medium: dict[str, int] = {}
        device = n
        counts = off_counts.get(w)
        if counts is not None:
            for idx, c in enumerate(counts):
                if c:
                    by_medium[MEDIUMS[idx]] = c
                    device -= c
        if device:
            by_medium["device"] = device
        result[w] = PrefixMatch(n, by_medium)

    def match_deepest(self, block_hashes: Sequence[bytes], now: float, limit: int,
                      also: Iterable[str] = (), rng: random.Random | None = None,
                      allowed: Container[str] | None = None) -> dict[str, PrefixMatch]:
        """The (at most) ``limit`` workers holding the longest leading runs of a request.

        Same counting as :meth:`match` (real and live speculative entries), but only for
        the deepest holders: workers are taken by decreasing match length, and among
        workers of the last length taken a subset fills the limit (drawn with ``rng``
        from the sorted ids, or the smallest ids without one). Workers
        with no matching block are never returned. For routing over a shortlist: the cost
        is O(matched blocks + limit) set operations instead of one result per known
        worker, so it does not grow with the fleet when every worker holds a shared
        first block.

        Args:
            block_hashes: the request's chained block hashes, first block first.
            now: current time on the clock used for :meth:`add_speculative` (seconds).
            limit: most deepest holders returned (workers), >= 0.
            also: workers whose matches are wanted as well, whatever their depth.
            rng: draws the subset of a level larger than what is left of ``limit``.
            allowed: only these workers count toward ``limit`` (None: all), so that holders
                the caller cannot use (a retry's tried workers, another model's) do not
                take the places of those it can.

        Returns:
            ``{worker_id: PrefixMatch}``, the deepest holders first, then those of
            ``also`` that match at least one block; each with ``num_blocks >= 1``.
        """
        self._purge_speculative(now)
        blocks = self._blocks
        spec = self._spec
        levels: list[tuple[int, set[str]]] = []   # (depth, workers reaching at least that depth)
        alive: set[str] = set()
        i = 0
        for h in block_hashes:
            nxt = _still_holding(blocks.get(h), spec.get(h), alive, i == 0)
            if not nxt:
                break
            if i and len(nxt) != len(alive):
                levels.append((i, alive))
            alive = nxt
            i += 1
        if i:
            levels.append((i, alive))
        depth: dict[str, int] = {}
        for d, ws in reversed(levels if limit > 0 else ()):
            new = [w for w in ws if w not in depth] if depth else list(ws)
            if allowed is not None:
                new = [w for w in new if w in allowed]
            need = limit - len(depth)
            if len(new) > need:
                # a level larger than what is left: a subset that does not depend on set order
                new.sort()
                new = rng.sample(new, need) if rng is not None else new[:need]
            for w in new:
                depth[w] = d
            if len(depth) >= limit:
                break
        for w in also:
            if w not in depth:
                for d, ws in reversed(levels):
                    if w in ws:
                        depth[w] = d
                        break
        off: dict[str, dict[str, int]] = {}
        if self._offdev and depth:
            offdev = self._offdev
            for j, h in enumerate(block_hashes[:max(depth.values())]):
                od = offdev.get(h)
                if od is None:
                    continue
                for w, m in od.items():
                    if depth.get(w, 0) > j:
                        by = off.setdefault(w, {})
                        by[MEDIUMS[m]] = by.get(MEDIUMS[m], 0) + 1
        out: dict[str, PrefixMatch] = {}
        for w, d in depth.items():
            by = off.get(w, {})
            dev = d - sum(by.values())
            if dev:
                by["device"] = dev
            out[w] = PrefixMatch(d, by)
        return out

    # -------------------------------------------------------------- internals
    def _add(self, h: bytes, wid: str, bits: int, state: _WorkerState) -> None:
        holders = self._blocks.get(h)
        if holders is None:
            holders = self._blocks[h] = {}
        old = holders.get(wid, 0)
        mask = old | bits
        if mask == old:
            return
        holders[wid] = mask
        state.hashes.add(h)
        self._set_best(h, wid, _BEST[mask])
        sp = self._spec.get(h)
        if sp is not None and wid in sp:  # a real entry supersedes the speculative one
            del sp[wid]
            if not sp:
                del self._spec[h]

    def _remove(self, h: bytes, wid: str, bits: int, state: _WorkerState) -> None:
        holders = self._blocks.get(h)
        if holders is None:
            return
        old = holders.get(wid)
        if old is None:
            return
        mask = old & ~bits
        if mask == old:
            return
        if mask:
            holders[wid] = mask
            self._set_best(h, wid, _BEST[mask])
            return
        del holders[wid]
        if not holders:
            del self._blocks[h]
        state.hashes.discard(h)
        self._set_best(h, wid, _DEVICE)

    def _set_best(self, h: bytes, wid: str, best: int) -> None:
        od = self._offdev.get(h)
        if best == _DEVICE:
            if od is not None and wid in od:
                del od[wid]
                if not od:
                    del self._offdev[h]
        elif od is None:
            self._offdev[h] = {wid: best}
        else:
            od[wid] = best

    def _clear(self, wid: str, state: _WorkerState) -> None:
        blocks = self._blocks
        offdev = self._offdev
        for h in state.hashes:
            holders = blocks[h]
            del holders[wid]
            if not holders:
                del blocks[h]
            od = offdev.get(h)
            if od is not None and wid in od:
                del od[wid]
                if not od:
                    del offdev[h]
        state.hashes = set()


def _still_holding(real, sp, alive: set[str], first: bool) -> set[str]:
    """Workers holding one more block of a chain: those of ``alive`` (every worker, for the
    first block) that hold it for real (``real``) or speculatively (``sp``); empty when none."""
    if real is None and sp is None:
        return set()
    if first:
        nxt = set(real) if real is not None else set()
        if sp is not None:
            nxt.update(sp)
        return nxt
    if real is None:
        return alive.intersection(sp)
    nxt = alive.intersection(real)
    if sp is not None and len(nxt) != len(alive):
        nxt.update(alive.intersection(sp))
    return nxt
