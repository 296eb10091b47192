"""Paged KV cache storage and the metadata pool that hands out its blocks.

:func:`allocate_kv_cache` makes the tensor; :class:`BlockPool` tracks which
blocks are free, held, or cached, and owns no tensor, so a simulator can use
it without one. The free queue is an intrusive doubly linked list that doubles
as the LRU order of cached blocks, after the design of vLLM's
``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``): a block whose
reference count drops to 0 joins the tail, allocation pops the head, and a
cached block popped from the head is evicted.

An allocation takes an empty block wherever it sits in the queue before it evicts
anything (a request's partial last block, freed after its cached blocks, sits behind
them; vLLM's queue would evict a cached block first).

**Owners.** A cached block may carry an owner (the tenant whose request cached it).
A block in use counts as its allocator's (`get_new_blocks`), a cached one as its owner's.
While more than one owner holds blocks, an allocation with no empty block left evicts the
least recently used cached block of the owner holding the most blocks (ties: the queue
head's owner):
max-min fair eviction, so a tenant that floods the pool evicts its own blocks once it
holds more than another, and a tenant holding fewer cached blocks than the largest holder
never loses one (between tenants holding equally many, the one whose block is at the queue
head loses). Choosing the owner costs O(owners with evictable blocks) per evicted block.
With one owner (or none) cached blocks are evicted in queue order (LRU).

**Protected shares** (`set_protection`, off by default). Blocks that running requests hold
cannot be evicted, so the rule above alone lets one tenant's running requests, once its own
cached blocks are gone, evict another tenant's blocks down to none. With a floor set, the
cached blocks of *idle* owners (named by the caller: tenants with no recent request) go
first, then those of the allocating owner and of owners holding more than the floor, by
the rule above; an owner at or under the floor loses a block only when nothing else is
evictable. `room_for` counts what an owner can be given without that, so a scheduler can
hold back a request that would need more (`workers.scheduler`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made: BlockPool itself needs none
    import torch

__all__ = ["allocate_kv_cache", "kv_bytes_per_block", "Block", "BlockPool"]


def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate a zeroed paged KV cache.

    Returns:
        Tensor of shape ``[num_blocks, num_layers, 2, num_kv_heads,
        block_size, head_dim]``; index 0 / 1 of dim 2 is K / V. Contiguous,
        so one block's KV for all layers is a single span of
        ``kv_bytes_per_block(...)`` bytes (one copy per block between tiers).

    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(
        num_blocks=num_blocks,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
    )
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    import torch

    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies in :func:`allocate_kv_cache`'s tensor (K and V, all layers).

    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(
        num_layers=num_layers, num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim
    )
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * block_size * head_dim * itemsize


@dataclass(slots=True, eq=False)
class Block:
    """Per-block metadata; ``prev``/``next`` link it into the free queue and, while it is
    evictable, ``oprev``/``onext`` into its owner's LRU list."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    owner: object = None
    oprev: Block | None = field(default=None, repr=False)
    onext: Block | None = field(default=None, repr=False)


#: key of the list of empty (ref 0, unhashed) blocks among the owner lists
_EMPTY = object()


class _OwnerLRU:
    """One owner's evictable blocks (or, under `_EMPTY`, the empty blocks), in queue order."""

    __slots__ = ("head", "tail", "count")

    def __init__(self) -> None:
        self.head = Block(-3)
        self.tail = Block(-3)
        self.head.onext = self.tail
        self.tail.oprev = self.head
        self.count = 0


class BlockPool:
    """Reference counts, hashes and the LRU free queue of ``num_blocks`` blocks.

    A block is in exactly one state: *empty* (ref 0, no hash), *evictable*
    (ref 0, hashed: cached and reusable until evicted) or *in use* (ref > 0,
    hashed or not). Every ref-0 block sits in the free queue; the queue's
    head is the next to be handed out.

    Args:
        num_blocks: number of blocks, > 0. Initially all empty, queued in id
            order.
        on_evict: called as ``on_evict(block_id, block_hash)`` when an
            evictable block is handed out again; must not raise.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    __slots__ = ("num_blocks", "_blocks", "_head", "_tail", "_fresh", "_num_free", "_num_evictable", "_on_evict",
                 "_lru", "_held", "_floor", "_idle")

    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None):
        _check_dims(num_blocks=num_blocks)
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        # Blocks are made on first use, so memory grows with the blocks handed out, not with
        # num_blocks: ids len(_blocks)..num_blocks-1 have never been used and sit, in id
        # order, where the `_fresh` marker sits in the free queue.
        self._blocks: list[Block] = []
        self._head = Block(-1)
        self._tail = Block(-1)
        self._fresh = Block(-2)
        self._head.next = self._fresh
        self._fresh.prev = self._head
        self._fresh.next = self._tail
        self._tail.prev = self._fresh
        self._num_free = num_blocks
        self._num_evictable = 0
        self._lru: dict[object, _OwnerLRU] = {}   # owners with evictable blocks
        self._held: dict[object, int] = {}        # owner -> cached (hashed) blocks, held or not
        self._floor: int | None = None            # protected share (`set_protection`); None: off
        self._idle: frozenset = frozenset()       # owners whose cached blocks go first

    # -- owner lists -------------------------------------------------------
    def _olink(self, b: Block, front: bool = False) -> None:
        key = b.owner if b.block_hash is not None else _EMPTY
        q = self._lru.get(key)
        if q is None:
            q = self._lru[key] = _OwnerLRU()
        if front:
            p = q.head
            n = p.onext
        else:
            n = q.tail
            p = n.oprev
        p.onext = b
        b.oprev = p
        b.onext = n
        n.oprev = b
        q.count += 1

    def _ounlink(self, b: Block) -> None:
        p, n = b.oprev, b.onext
        p.onext = n
        n.oprev = p
        b.oprev = b.onext = None
        key = b.owner if b.block_hash is not None else _EMPTY
        q = self._lru[key]
        q.count -= 1
        if q.count == 0:
            del self._lru[key]

    def _drop_held(self, owner: object) -> None:
        left = self._held[owner] - 1
        if left:
            self._held[owner] = left
        else:
            del self._held[owner]

    def _victim(self, head: Block, owner: object) -> Block:
        """The evictable block to hand out next to ``owner``: the LRU block of the owner
        holding the most cached blocks (``head``, the queue head, when its owner is among
        them); with a protected share, idle owners' first and owners at or under the floor
        last (module docstring)."""
        if self._floor is not None:
            floor, idle = self._floor, self._idle
            pick_idle = pick = None
            most_idle = most = -1
            for o, q in self._lru.items():
                if o is _EMPTY:
                    continue
                held = self._held[o]
                if o in idle:
                    if held > most_idle:
                        pick_idle, most_idle = q.head.onext, held
                elif (o == owner or held > floor) and held > most:
                    pick, most = q.head.onext, held
            if pick_idle is not None:
                return pick_idle
            if pick is not None:
                return pick
        best, most = head, self._held[head.owner]
        for owner, q in self._lru.items():
            if owner is _EMPTY:
                continue
            held = self._held[owner]
            if held > most:
                best, most = q.head.onext, held
        return best

    # -- free queue primitives -------------------------------------------
    def _unlink(self, b: Block) -> None:
        p, n = b.prev, b.next
        p.next = n
        n.prev = p
        b.prev = b.next = None
        self._num_free -= 1
        if b.block_hash is not None:
            self._num_evictable -= 1
        self._ounlink(b)

    def _append(self, b: Block) -> None:
        t = self._tail
        p = t.prev
        p.next = b
        b.prev = p
        b.next = t
        t.prev = b
        self._num_free += 1
        if b.block_hash is not None:
            self._num_evictable += 1
        self._olink(b)

    def _push_front(self, b: Block) -> None:
        h = self._head
        n = h.next
        h.next = b
        b.prev = h
        b.next = n
        n.prev = b
        self._num_free += 1
        self._olink(b, front=True)

    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
        if block_id < len(self._blocks):
            return self._blocks[block_id]
        return Block(block_id)  # never used: ref 0, no hash (a detached stand-in)

    def _take_fresh(self, owner: object = None) -> Block:
        """Make the lowest never-used block (held, ref 1, for ``owner``); drop the marker when
        none is left."""
        b = Block(len(self._blocks), ref_cnt=1, owner=owner)
        self._held[owner] = self._held.get(owner, 0) + 1
        self._blocks.append(b)
        self._num_free -= 1
        if len(self._blocks) == self.num_blocks:
            f = self._fresh
            f.prev.next = f.next
            f.next.prev = f.prev
            f.prev = f.next = None
        return b

    # -- public API --------------------------------------------------------
    def get_new_blocks(self, n: int, owner: object = None) -> list[int] | None:
        """Take ``n`` blocks from the free queue: empty ones first, then cached ones from the
        head (LRU first; between owners, see the module docstring), for ``owner`` (they
        count as its from now on).

        Each returned block has ref 1 and no hash. A popped block that was
        cached is evicted: ``on_evict(block_id, hash)`` is called, then its
        hash is cleared.

        Returns:
            the block ids in pop order, or None (pool untouched) when fewer
            than ``n`` blocks have ref 0.

        Raises:
            ValueError: ``n`` < 0.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self._num_free:
            return None
        out = []
        on_evict = self._on_evict
        fresh = self._fresh
        for _ in range(n):
            b = self._head.next
            if b is fresh:
                out.append(self._take_fresh(owner).block_id)
                continue
            if b.block_hash is not None:  # an empty block wherever it sits, before evicting anything
                empties = self._lru.get(_EMPTY)
                if empties is not None:
                    b = empties.head.onext
                elif len(self._held) > 1:  # several owners: fairness
                    b = self._victim(b, owner)
            self._unlink(b)
            b.ref_cnt = 1
            h = b.block_hash
            if h is not None:
                if on_evict is not None:
                    on_evict(b.block_id, h)
                b.block_hash = None
                self._drop_held(b.owner)
            b.owner = owner
            self._held[owner] = self._held.get(owner, 0) + 1
            out.append(b.block_id)
        return out

    def set_protection(self, floor: int | None, idle: Iterable[object] = ()) -> None:
        """Protect each owner's first ``floor`` blocks (in use or cached) from the other
        owners' allocations while anything else is evictable; the cached blocks of the
        owners in ``idle`` are evicted before anyone's. ``floor`` None turns it off (the
        default: plain max-min fair eviction, module docstring).

        Raises:
            ValueError: ``floor`` < 0.
        """
        if floor is not None and floor < 0:
            raise ValueError(f"floor must be >= 0 (got {floor})")
        self._floor = floor
        self._idle = frozenset(idle) if floor is not None else frozenset()

    def room_for(self, owner: object) -> int:
        """Blocks ``owner`` can be given without taking a cached block of another owner
        that is not idle and holds no more than the protected floor (`set_protection`):
        empty blocks, idle owners' and its own cached blocks, and what other owners hold
        above the floor. Without protection, every ref-0 block. O(owners) (blocks)."""
        if self._floor is None:
            return self._num_free
        room = self._num_free - self._num_evictable
        for o, q in self._lru.items():
            if o is _EMPTY:
                continue
            if o == owner or o in self._idle:
                room += q.count
            else:
                room += min(q.count, max(0, self._held[o] - self._floor))
        return room

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a ref-0 block leaves the free queue.

        This is how a cached prefix is locked against eviction.

        Raises:
            IndexError: an id is out of range.
            ValueError: a block has ref 0 and no hash (touch only reuses
                cached or held blocks; use ``get_new_blocks`` for new ones).
            Nothing is changed when an error is raised.
        """
        blocks = [self._block(i) for i in block_ids]
        for b in blocks:
            if b.ref_cnt == 0 and b.block_hash is None:
                raise ValueError(f"block {b.block_id} is empty; allocate it instead")
        for b in blocks:
            if b.ref_cnt == 0:
                self._unlink(b)
            b.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; a block reaching ref 0 joins the queue tail.

        Pass a sequence's blocks tail-first (reversed) so that cached chain
        tails are evicted before their parents.

        Raises:
            IndexError: an id is out of range.
            ValueError: a block would drop below ref 0. Nothing is changed
                when an error is raised.
        """
        blocks = [self._block(i) for i in block_ids]
        if len({id(b) for b in blocks}) == len(blocks):
            for b in blocks:
                if b.ref_cnt < 1:
                    raise ValueError(f"block {b.block_id} freed more often than held")
        else:
            for b, k in Counter(blocks).items():
                if b.ref_cnt < k:
                    raise ValueError(f"block {b.block_id} freed more often than held")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:  # empty now: nobody's
                    self._drop_held(b.owner)
                    b.owner = None
                self._append(b)

    def set_hash(self, block_id: int, block_hash: bytes, owner: object = None) -> None:
        """Mark a held block as holding the KV of ``block_hash`` (set once), cached for
        ``owner`` (any hashable, e.g. a tenant id; None: nobody in particular).

        Raises:
            IndexError: id out of range.
            TypeError: ``block_hash`` is not bytes.
            ValueError: the block has ref 0 or already has a hash.
        """
        b = self._block(block_id)
        if not isinstance(block_hash, bytes):
            raise TypeError("block_hash must be bytes")
        if b.ref_cnt == 0:
            raise ValueError(f"block {block_id} is not held")
        if b.block_hash is not None:
            raise ValueError(f"block {block_id} already has a hash")
        b.block_hash = block_hash
        if owner != b.owner:  # counted for whoever allocated it until now
            self._drop_held(b.owner)
            self._held[owner] = self._held.get(owner, 0) + 1
            b.owner = owner

    def clear_hash(self, block_id: int) -> bytes | None:
        """Forget a block's hash (its KV is no longer to be reused).

        A ref-0 block becomes empty and moves to the queue head, so it is
        reused before any cached block. ``on_evict`` is not called.

        Returns:
            the hash it had, or None.

        Raises:
            IndexError: id out of range.
        """
        b = self._block(block_id)
        h = b.block_hash
        if h is None:
            return None
        if b.ref_cnt == 0:
            self._unlink(b)
            b.block_hash = None
            self._drop_held(b.owner)
            b.owner = None
            self._push_front(b)
        else:  # still in use by its owner's request
            b.block_hash = None
        return h

    def get_owner(self, block_id: int) -> object:
        """The owner a cached block was set with (`set_hash`), None if none. Raises IndexError."""
        return self._block(block_id).owner

    def get_hash(self, block_id: int) -> bytes | None:
        """The block's hash, or None. Raises IndexError for a bad id."""
        return self._block(block_id).block_hash

    def ref_cnt(self, block_id: int) -> int:
        """The block's reference count. Raises IndexError for a bad id."""
        return self._block(block_id).ref_cnt

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0 (empty + evictable)."""
        return self._num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks with ref 0 that still hold a hash."""
        return self._num_evictable

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks with ref > 0."""
        return self.num_blocks - self._num_free

    def blocks_by_owner(self) -> dict:
        """Blocks per owner: those in use by its requests and those cached for it."""
        return dict(self._held)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return (self.num_blocks - self._num_free) / self.num_blocks

    def free_queue(self) -> list[int]:
        """Block ids in the free queue, head first: with one owner (or none), the hand-out
        order of cached blocks once no empty one is left. O(num_blocks)."""
        out = []
        b = self._head.next
        while b is not self._tail:
            if b is self._fresh:
                out.extend(range(len(self._blocks), self.num_blocks))
            else:
                out.append(b.block_id)
            b = b.next
        return out

    def check_integrity(self) -> None:
        """Verify queue links and counters against the per-block state.

        Raises:
            RuntimeError: describing every inconsistency found.
        """
        errors: list[str] = []
        seen: set[int] = set()
        queued_hashed = 0
        prev = self._head
        b = self._head.next
        steps = 0
        fresh = self.num_blocks - len(self._blocks)
        while b is not self._tail:
            if b is None:
                errors.append(f"queue broken after block {prev.block_id}")
                break
            steps += 1
            if steps > self.num_blocks + 1:
                errors.append("free queue longer than the pool (cycle?)")
                break
            if b.prev is not prev:
                errors.append(f"block {b.block_id}: prev link does not point to {prev.block_id}")
            if b is self._fresh:
                if not fresh:
                    errors.append("never-used marker queued with no never-used block left")
                fresh = -1
                prev, b = b, b.next
                continue
            if b.block_id in seen:
                errors.append(f"block {b.block_id} queued twice")
            if not 0 <= b.block_id < self.num_blocks or self._blocks[b.block_id] is not b:
                errors.append(f"foreign block {b.block_id} in queue")
            seen.add(b.block_id)
            if b.ref_cnt != 0:
                errors.append(f"block {b.block_id} queued with ref {b.ref_cnt}")
            if b.block_hash is not None:
                queued_hashed += 1
            prev, b = b, b.next
        if b is self._tail and self._tail.prev is not prev:
            errors.append("tail sentinel prev link is stale")
        if fresh > 0:
            errors.append(f"{fresh} never-used blocks but no marker in the queue")
        ref0 = 0
        for blk in self._blocks:
            if blk.ref_cnt < 0:
                errors.append(f"block {blk.block_id} has ref {blk.ref_cnt}")
            if blk.ref_cnt == 0:
                ref0 += 1
                if blk.block_id not in seen:
                    errors.append(f"block {blk.block_id} has ref 0 but is not queued")
            elif blk.prev is not None or blk.next is not None:
                errors.append(f"held block {blk.block_id} still linked")
        if len(seen) != ref0:
            errors.append(f"queue holds {len(seen)} blocks, {ref0} have ref 0")
        ref0 += self.num_blocks - len(self._blocks)  # never used: empty, ref 0
        if self._num_free != ref0:
            errors.append(f"num_free counter {self._num_free} != {ref0} ref-0 blocks")
        if self._num_evictable != queued_hashed:
            errors.append(f"num_evictable counter {self._num_evictable} != {queued_hashed}")
        empty = ref0 - queued_hashed
        if empty + queued_hashed + self.num_in_use_blocks != self.num_blocks:
            errors.append("empty + evictable + in_use != num_blocks")
        held: dict = {}
        for blk in self._blocks:
            if blk.block_hash is not None or blk.ref_cnt > 0:
                held[blk.owner] = held.get(blk.owner, 0) + 1
            elif blk.owner is not None:
                errors.append(f"empty block {blk.block_id} has owner {blk.owner!r}")
        if held != self._held:
            errors.append(f"cached blocks per owner {self._held} != {held}")
        in_lists = empties = 0
        for owner, q in self._lru.items():
            n, o = 0, q.head.onext
            while o is not q.tail and o is not None and n <= self.num_blocks:
                wrong = (o.block_hash is not None or o.owner is not None) if owner is _EMPTY else (
                    o.owner != owner or o.block_hash is None)
                if wrong or o.ref_cnt != 0:
                    errors.append(f"block {o.block_id} in {owner!r}'s list: owner {o.owner!r}, ref {o.ref_cnt}")
                n, o = n + 1, o.onext
            if n != q.count or n == 0:
                errors.append(f"owner {owner!r}: list of {n} blocks, count {q.count}")
            if owner is _EMPTY:
                empties = n
            else:
                in_lists += n
        if in_lists != queued_hashed:
            errors.append(f"{in_lists} blocks in owner lists, {queued_hashed} evictable")
        if empties != len(seen) - queued_hashed:
            errors.append(f"{empties} blocks in the empty list, {len(seen) - queued_hashed} queued empty")
        if errors:
            raise RuntimeError("BlockPool integrity: " + "; ".join(errors))

    def reset(self) -> list[int]:
        """Drop every hash; only allowed when no block is in use.

        ``on_evict`` is not called; the caller drops its own index.

        Returns:
            ids of the blocks that had a hash, in free-queue order.

        Raises:
            RuntimeError: some block has ref > 0.
        """
        if self._num_free != self.num_blocks:
            raise RuntimeError(f"reset with {self.num_in_use_blocks} blocks in use")
        out = []
        b = self._head.next
        while b is not self._tail:
            if b.block_hash is not None and b is not self._fresh:
                b.block_hash = None
                b.owner = None
                out.append(b.block_id)
            b = b.next
        self._num_evictable = 0
        self._held.clear()
        self._lru.clear()  # every queued block is empty now: one empty list, in queue order
        b = self._head.next
        while b is not self._tail:
            if b is not self._fresh:
                b.oprev = b.onext = None
                self._olink(b)
            b = b.next
        return out
