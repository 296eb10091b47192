"""A worker's prefix cache: block pool + radix index + KV events.

Plays the role of vLLM's ``KVCacheManager`` / ``BlockPool`` pair for one
cache tier: it finds the cached prefix of a request, locks it, allocates new
blocks (evicting least recently used cached blocks), registers blocks once
their KV is computed, and reports every change as a KV event
(:mod:`cache_store.events`).

Request life cycle, for a sequence hashed into ``bh`` (a ``BlockHashes``)::

    hit = cache.match(bh)                  # cached prefix, nothing changes
    cache.lock(hit.block_ids)              # before any allocate()
    new = cache.allocate(n)                # None: not enough free blocks
    ids = hit.block_ids + new              # ids[i] holds block i
    ...compute KV for blocks len(hit.block_ids)..
    cache.commit(bh, ids, len(hit.block_ids), num_full_blocks)
    cache.unlock(ids)                      # frees tail-first

Eviction order. The pool's free queue is the LRU. ``unlock`` frees a
sequence's blocks tail-first, and ``commit`` only registers a block under a
parent that the same sequence holds, so a cached block never has ref 0 while
a child of it is held, and in the queue every cached child sits before its
parent: eviction always takes index leaves first. :meth:`check_integrity`
verifies this.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from kvmesh.cache_store.block_pool import BlockPool
from kvmesh.cache_store.events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.cache_store.hashing import BlockHashes, hash_block, hash_blocks
from kvmesh.cache_store.radix_index import RadixIndex

__all__ = ["PrefixMatch", "PrefixCache", "EvictedBlock"]


class PrefixMatch(NamedTuple):
    """Cached prefix of a sequence.

    Attributes:
        block_ids: ids of the cached blocks, block 0 first.
        num_cached_tokens: ``len(block_ids) * block_size`` (tokens).
    """

    block_ids: list[int]
    num_cached_tokens: int


class EvictedBlock(NamedTuple):
    """A cached block the pool is handing out again, reported before its KV is overwritten.

    Attributes:
        block_id: pool row that still holds the block's KV.
        block_hash: its 16-byte chained hash.
        parent_hash: the previous block's hash; None for block 0.
        token_bytes: its token ids as little-endian uint32.
        owner: the tenant it was cached for (`BlockPool.set_hash`), None if none; lower
            tiers evict fairly between owners too.
    """

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_bytes: bytes
    owner: object = None


class PrefixCache:
    """Block pool and radix index of one worker's KV cache tier.

    Args:
        num_blocks: blocks in the pool, > 0.
        block_size: tokens per block, > 0.
        event_sink: receives each ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` as it happens; None drops them.
        hash_fn: block hash function used by :meth:`hash_blocks`.
        medium: the ``medium`` field of emitted events, one of ``MEDIUMS``.
        on_offload: called once per :meth:`allocate` that evicts cached
            blocks, with the list of :class:`EvictedBlock`, before
            ``allocate`` returns: the blocks' KV is intact until the caller
            writes into the blocks it was handed, so the callback may copy it
            to a lower tier. Must not raise.
        row_rank: ``row_rank(block_id)`` is the loss rank of the KV a block
            holds (`kv_codec.loss_rank`: 0 exact, higher lossier; a worker's
            `TierStore.row_loss`). :meth:`commit` then replaces a cached block
            by a less lossy copy of the same block. None: every block is as good
            as any other, and a cached block is never replaced.

    Not thread-safe: one scheduler owns it.

    Raises:
        ValueError: bad sizes or unknown medium.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        event_sink: Callable[[object], None] | None = None,
        hash_fn: Callable[[bytes, bytes], bytes] = hash_block,
        medium: str = "device",
        on_offload: Callable[[list[EvictedBlock]], None] | None = None,
        row_rank: Callable[[int], int] | None = None,
    ):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if medium not in MEDIUMS:
            raise ValueError(f"unknown medium {medium!r}; expected one of {MEDIUMS}")
        self.block_size = block_size
        self.medium = medium
        self.hash_fn = hash_fn
        self._sink = event_sink
        self.index = RadixIndex()
        self.pool = BlockPool(num_blocks, on_evict=self._on_evict)
        self._evicted: list[bytes] = []
        self._on_offload = on_offload
        self._offload: list[EvictedBlock] = []
        self.num_orphan_evictions = 0  # descendants dropped with an evicted parent
        self.row_rank = row_rank
        #: cached blocks replaced by a less lossy copy of the same block (`commit`)
        self.num_replaced = 0

    # -- hashing -------------------------------------------------------------
    def hash_blocks(self, token_ids: Sequence[int], parent_hash: bytes) -> BlockHashes:
        """``hashing.hash_blocks`` with this cache's block size and hash function."""
        return hash_blocks(token_ids, self.block_size, parent_hash, self.hash_fn)

    # -- lookup and locking ----------------------------------------------------
    def match(self, block_hashes: BlockHashes) -> PrefixMatch:
        """Longest cached prefix of a sequence (token bytes verified). Changes nothing.

        The returned blocks may be evicted by the next :meth:`allocate`
        unless :meth:`lock` is called first. A scheduler that needs logits
        for the last prompt token should match on hashes of all but the
        last token.

        Raises:
            ValueError: ``block_hashes`` uses another block size.
        """
        if block_hashes.block_size != self.block_size:
            raise ValueError(f"block size {block_hashes.block_size} != cache's {self.block_size}")
        r = self.index.match(block_hashes.hashes, block_hashes.block_tokens)
        return PrefixMatch(r.values, r.num_blocks * self.block_size)

    def lock(self, block_ids: Sequence[int]) -> None:
        """Hold blocks (a matched prefix) so they cannot be evicted. See ``BlockPool.touch``."""
        self.pool.touch(block_ids)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """Release a sequence's blocks (given block 0 first; freed tail-first)."""
        self.pool.free(reversed(list(block_ids)))

    # -- allocation --------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        """True if :meth:`allocate` of ``n`` blocks would succeed. Changes nothing."""
        return 0 <= n <= self.pool.num_free_blocks

    def allocate(self, n: int, owner: object = None) -> list[int] | None:
        """Take ``n`` free blocks (ref 1) for ``owner`` (the requesting tenant), evicting
        cached blocks as needed (LRU; fair between owners, see `BlockPool`).

        Evicted blocks leave the index and are reported in one
        ``BlockRemoved`` event.

        Returns:
            block ids, or None (nothing changed) if fewer than ``n`` are free.

        Raises:
            ValueError: ``n`` < 0.
        """
        got = self.pool.get_new_blocks(n, owner)
        if self._offload:
            batch, self._offload = self._offload, []
            self._on_offload(batch)
        if self._evicted:
            hashes, self._evicted = self._evicted, []
            self._emit(BlockRemoved(hashes, self.medium))
        return got

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        node = self.index.node(block_hash)
        assert node is not None and node.value == block_id, (
            f"evicted block {block_id} is not the index entry for its hash"
        )
        if self._on_offload is not None:
            parent = node.parent.block_hash if node.parent is not None else None
            self._offload.append(EvictedBlock(block_id, block_hash, parent, node.tokens, self.pool.get_owner(block_id)))
        removed = self.index.remove(block_hash)
        self._evicted.append(block_hash)
        # A well-behaved caller never gets here with descendants left (see
        # the module docstring); if one did, its subtree is dropped too.
        for v in removed[1:]:
            self.num_orphan_evictions += 1
            h = self.pool.clear_hash(v)
            if h is not None:
                self._evicted.append(h)

    def evict_unused(self) -> int:
        """Evict every cached block with ref 0 through the normal eviction path
        (``on_offload`` and ``BlockRemoved`` included), LRU first.

        Used to move a cache's contents down to the lower tiers (tests,
        benchmarks, a drain before shutdown).

        Returns:
            number of blocks evicted.
        """
        n = self.pool.num_evictable_blocks
        if n == 0:
            return 0
        got = self.allocate(self.pool.num_free_blocks)
        if got:
            self.pool.free(got)
        return n

    # -- registration ------------------------------------------------------------
    def commit(self, block_hashes: BlockHashes, block_ids: Sequence[int], start: int, end: int,
               owner: object = None) -> int:
        """Register full blocks ``start .. end-1`` of a sequence as cached, for ``owner`` (the
        tenant whose request computed them: eviction is fair between owners, see
        `BlockPool`).

        ``block_hashes`` is a ``BlockHashes`` or any object with the same
        members (``hashes``, ``block_size``, ``token_bytes``,
        ``block_tokens``). ``block_ids[i]`` holds block ``i``; the blocks
        must be held by the caller. Blocks already cached as the same ids are skipped. Caching
        stops (the rest stays uncached and is simply freed later) at the
        first block whose hash is cached under another block id (another
        sequence computed it meanwhile) or collides; and nothing is cached
        when block ``start-1`` is not this sequence's cached block, so a
        block is only ever cached below a parent its sequence holds. Emits
        one ``BlockStored`` for the newly cached run, parent hash = the hash
        of the block before the run (None for block 0).

        Less lossy copies (``row_rank``): where a block's hash is cached, in
        this sequence's chain, under another block whose KV is lossier than
        this sequence's (a copy decoded from a lossy codec, or computed over
        one, where this sequence computed it over exact context), this
        sequence's block takes its place in the index: the hash stays cached,
        now by the better copy, so later requests reuse that one, and a
        request that must not reuse lossy KV finds it. The replaced block
        loses its hash; a request holding it keeps its KV (it is freed when
        that request lets it go) but caches nothing more below it. Cached
        children of the replaced block stay cached below the new one, except
        those held by a request, which are uncached with what is below them
        (reported in one ``BlockRemoved``): a held child's parent must stay
        held as long as it is. Equal or lossier copies never replace.

        Returns:
            number of blocks newly cached (replacements included).

        Raises:
            ValueError: bad range, block size mismatch, too few block ids, a
                repeated block id, or a block to register that is not held or
                already holds another hash.
            IndexError: a block id is out of range.
        """
        bs = block_hashes.block_size
        if bs != self.block_size:
            raise ValueError(f"block size {bs} != cache's {self.block_size}")
        hashes = block_hashes.hashes
        if not 0 <= start <= end <= len(hashes):
            raise ValueError(f"bad block range [{start}, {end}) for {len(hashes)} full blocks")
        if len(block_ids) < end:
            raise ValueError(f"{len(block_ids)} block ids for blocks up to {end}")
        index, pool = self.index, self.pool
        prev = None  # the node of block first-1 (None: block 0 is next)
        if start > 0:
            prev = index.node(hashes[start - 1])
            if prev is None or prev.value != block_ids[start - 1] or prev.depth != start:
                return 0
        first = start
        while first < end:
            node = index.node(hashes[first])
            if node is None:
                break
            if node.value != block_ids[first]:
                if not self._better_copy(node, prev, block_ids[first], block_hashes, first):
                    return 0  # cached under another block id, as good (or a collision)
                break
            prev, first = node, first + 1
        if first == end:
            return 0
        run = block_ids[first:end]
        if len(set(run)) != len(run):
            raise ValueError("a block id appears twice")
        for bid in run:
            if pool.ref_cnt(bid) < 1:
                raise ValueError(f"block {bid} is not held")
            if pool.get_hash(bid) is not None:
                raise ValueError(f"block {bid} already holds another block's hash")
        removed: list[bytes] = []
        replaced = 0
        while first < end:  # blocks cached as lossier copies: this sequence's take their place
            node = index.node(hashes[first])
            if node is None:
                break
            if not self._better_copy(node, prev, block_ids[first], block_hashes, first):
                if removed:
                    self._emit(BlockRemoved(removed, self.medium))
                return replaced
            removed += self._replace(node, block_ids[first], owner)
            replaced += 1
            prev, first = node, first + 1
        if removed:
            self._emit(BlockRemoved(removed, self.medium))
        if first == end:
            return replaced
        inserted = index.extend(hashes, block_hashes.block_tokens, block_ids, first, end)
        if not inserted:
            return replaced
        for i in inserted:
            pool.set_hash(block_ids[i], hashes[i], owner)
        lo, hi = inserted[0], inserted[-1] + 1
        assert hi - lo == len(inserted), "extend inserts one contiguous run"
        step = bs * 4
        toks = block_hashes.token_bytes[lo * step : hi * step]
        self._emit(
            BlockStored(
                block_hashes=hashes[lo:hi],
                parent_block_hash=hashes[lo - 1] if lo > 0 else None,
                token_ids=_u32_list(toks),
                block_size=bs,
                medium=self.medium,
            )
        )
        return replaced + len(inserted)

    def _better_copy(self, node, prev, block_id: int, block_hashes, i: int) -> bool:
        """True if ``block_id``, a sequence's block ``i``, may replace the cached ``node`` of
        the same hash: its KV is less lossy (``row_rank``) and ``node`` is that sequence's block
        ``i`` (below ``prev``, the sequence's block ``i-1``, or the root; same token bytes)."""
        rank = self.row_rank
        if rank is None or not rank(block_id) < rank(node.value):
            return False
        parent = node.parent
        if prev is not None:
            if parent is not prev:
                return False
        elif parent is None or parent.block_hash is not None:
            return False
        return node.tokens == block_hashes.block_tokens(i)

    def _replace(self, node, block_id: int, owner: object) -> list[bytes]:
        """Cache ``block_id`` (held, no hash) as ``node``'s block in place of the one there.

        Children of ``node`` held by a request are uncached first, with what is below them
        (their holders keep their KV): they would otherwise stay cached below a block that
        may be freed before them. The replaced block loses its hash: freed at once when
        nobody holds it, else when its holders let it go.

        Returns:
            the hashes uncached.
        """
        pool, index = self.pool, self.index
        removed: list[bytes] = []
        for child in list(node.children.values()):
            if pool.ref_cnt(child.value) > 0:
                for bid in index.remove(child.block_hash):
                    h = pool.clear_hash(bid)
                    if h is not None:
                        removed.append(h)
        old = index.set_value(node.block_hash, block_id)
        pool.clear_hash(old)
        pool.set_hash(block_id, node.block_hash, owner)
        self.num_replaced += 1
        return removed

    # -- whole-cache operations ----------------------------------------------------
    def clear(self) -> int:
        """Uncache every block and emit ``AllBlocksCleared``.

        Blocks in use keep their KV for their holders but are no longer
        shared; later commits of their sequences cache nothing (their
        prefix is gone). Used when cached KV becomes invalid, e.g. new
        weights.

        Returns:
            number of blocks uncached.
        """
        n = 0
        for _, bid in list(self.index.items()):
            if self.pool.clear_hash(bid) is not None:
                n += 1
        self.index.clear()
        self._emit(AllBlocksCleared())
        return n

    def check_integrity(self) -> None:
        """Check pool, index and their agreement, including the eviction order.

        Verifies: pool and index integrity; every index payload is a block
        whose pool hash is the node's hash; every hashed block is indexed;
        free + in_use == num_blocks; a held cached block's parent is held;
        in the free queue a cached block precedes its cached parent.

        Raises:
            RuntimeError: describing every inconsistency found.
        """
        self.pool.check_integrity()
        self.index.check_integrity()
        pool, errors = self.pool, []
        for h, bid in self.index.items():
            if not isinstance(bid, int) or not 0 <= bid < pool.num_blocks:
                errors.append(f"index payload {bid!r} is not a block id")
                continue
            if pool.get_hash(bid) != h:
                errors.append(f"block {bid}: pool hash differs from index hash {h.hex()}")
        hashed = sum(1 for b in range(pool.num_blocks) if pool.get_hash(b) is not None)
        if hashed != len(self.index):
            errors.append(f"{hashed} hashed blocks, {len(self.index)} indexed")
        if pool.num_free_blocks + pool.num_in_use_blocks != pool.num_blocks:
            errors.append("free + in_use != num_blocks")
        pos = {bid: i for i, bid in enumerate(pool.free_queue())}
        for h, bid in self.index.items():
            node = self.index.node(h)
            parent = node.parent
            if parent is None or parent.block_hash is None:
                continue
            pbid = parent.value
            if pool.ref_cnt(bid) > 0 and pool.ref_cnt(pbid) == 0:
                errors.append(f"block {bid} held but its parent {pbid} is not")
            if bid in pos and pbid in pos and pos[bid] > pos[pbid]:
                errors.append(f"parent {pbid} would be evicted before its child {bid}")
        if errors:
            raise RuntimeError("PrefixCache integrity: " + "; ".join(errors))

    def stats(self) -> dict:
        """Block counts: num_blocks, free, evictable, in_use, cached (index size)."""
        p = self.pool
        return {
            "num_blocks": p.num_blocks,
            "free": p.num_free_blocks,
            "evictable": p.num_evictable_blocks,
            "in_use": p.num_in_use_blocks,
            "cached": len(self.index),
        }

    def _emit(self, event: object) -> None:
        if self._sink is not None:
            self._sink(event)


def _u32_list(token_bytes: bytes) -> list[int]:
    return np.frombuffer(token_bytes, dtype="<u4").tolist()
