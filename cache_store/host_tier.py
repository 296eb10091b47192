"""Host-memory tier: encoded KV blocks in one preallocated slab, with its own LRU.

The slab is a ``[num_slots, payload_bytes]`` uint8 tensor in host memory
(page-locked when the pool lives on a CUDA device, so device-to-host copies
can run asynchronously), where ``num_slots = capacity_bytes // payload_bytes``
of the tier's codec. Each entry maps a block hash to a slot plus what is
needed to verify and advertise the block (parent hash, token ids).

Copies are batched: a batch of evicted device blocks is gathered with one
``index_select`` per run of consecutive free slots, straight into the slab
(the exact codec) or through the codec's encoder. Free slots are handed out
lowest first (the free list is re-sorted only after slots were given back),
so runs are long.

A slot can be *pinned* (a disk write or a load is reading it): an entry whose
slot is pinned is never evicted, and a removed entry's slot is only reused
once unpinned.

Eviction is fair between tenants, as in the device pool (`cache_store.block_pool`): a
block's tenant is its identity's ``owner`` (``EvictedBlock.owner``; None for blocks read
back from disk, the remote tier or a peer). While entries of several tenants are held,
each eviction takes the least recently used unpinned entry of the tenant holding the most
entries; with one tenant it is plain LRU. Not thread-safe: :class:`cache_store.tier_store.TierStore`
serializes access under its lock.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch

from kvmesh.cache_store.kv_codec import KVCodec

__all__ = ["BlockIdentity", "HostEntry", "HostTier"]

_ZERO_HASH = bytes(16)


class BlockIdentity(Protocol):
    """What the host tier keeps about a block besides its payload (``EvictedBlock`` and
    ``RecordMeta`` both fit): ``parent_hash`` may be None or 16 zero bytes for block 0."""

    block_hash: bytes
    parent_hash: bytes | None
    token_bytes: bytes


def _tenant(block: BlockIdentity) -> object:
    return getattr(block, "owner", None)


@dataclass(slots=True, frozen=True)
class HostEntry:
    """A read-only view of one block in the host tier (built on request by :meth:`HostTier.get`).

    Attributes:
        block_hash: 16-byte chained hash.
        parent_hash: previous block's hash, ``ZERO_HASH`` for block 0.
        token_bytes: the block's token ids as little-endian uint32.
        slot: slab row holding the payload.
        origin: medium the block is credited to when loaded: the tier's
            medium (``"host"``, or ``"peer"`` for the staging area of peer fetches).
        on_disk: a disk copy exists or is queued.
        ready: CUDA event the copy into the slot was recorded with (None on
            CPU); wait on it before reading the slot from the CPU.
    """

    block_hash: bytes
    parent_hash: bytes
    token_bytes: bytes
    slot: int
    origin: str
    on_disk: bool = False
    ready: object = None


class HostTier:
    """A slab of encoded blocks with an LRU over its entries.

    Per-block state lives in per-slot lists, not in one object per block, so
    that offloading a batch of ``n`` blocks costs a few list stores per block
    besides the copy itself (``n`` is ~1,000 per batch on a busy worker).

    Args:
        capacity_bytes: slab size budget (bytes); ``capacity_bytes //
            codec.payload_bytes`` blocks fit. 0 makes an empty tier.
        codec: codec of the stored payloads.
        pin_memory: allocate page-locked memory (only when CUDA is available).
        medium: the medium name this tier reports ("host"; "peer" for the
            staging area of peer fetches).

    Raises:
        ValueError: negative capacity.
    """

    def __init__(self, capacity_bytes: int, codec: KVCodec, pin_memory: bool = False, medium: str = "host"):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.codec = codec
        self.medium = medium
        self.capacity_bytes = int(capacity_bytes)
        self.num_slots = n = self.capacity_bytes // codec.payload_bytes
        pin = bool(pin_memory and torch.cuda.is_available())
        self.slab = torch.empty((max(n, 1), codec.payload_bytes), dtype=torch.uint8, pin_memory=pin)
        self._slab_mv = memoryview(self.slab.numpy()).cast("B")  # flat zero-copy view: rows are slices
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest first
        self._by_tenant: dict[object, OrderedDict[bytes, int]] = {}  # the same entries per tenant
        self._free = list(range(n - 1, -1, -1))  # free slots; sorted descending when not _unsorted
        self._unsorted = False
        self._owner: list[bytes | None] = [None] * n  # hash of the entry on the slot; b"" = reserved
        self._pins = [0] * n
        # identity of the block last stored in each slot (kept after removal, for held slots)
        self._block: list[BlockIdentity | None] = [None] * n
        self._on_disk = bytearray(n)
        self._ready: list[object] = [None] * n
        self._origin: list[str | None] = [None] * n  # medium credited, when not the tier's own
        # loss rank (`kv_codec.loss_rank`) of the KV each slot was stored from: lossy when the
        # block was loaded into the pool from a compressed tier or record before it came here
        self._loss = bytearray(n)

    # -- queries ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.entries

    def slot_of(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None."""
        return self.entries.get(block_hash)

    def get(self, block_hash: bytes) -> HostEntry | None:
        """A view of the entry for ``block_hash``, or None."""
        slot = self.entries.get(block_hash)
        return None if slot is None else self.view(slot)

    def loss_rank(self, slot: int) -> int:
        """Loss rank of the KV in ``slot``: the highest of the codecs it went through before
        it was stored here and of this tier's own codec (`kv_codec.loss_rank`)."""
        return max(self._loss[slot], self.codec.loss_rank)

    def view(self, slot: int) -> HostEntry:
        """A view of the block last stored in ``slot`` (also after it was removed while pinned).

        Raises:
            ValueError: nothing was ever stored in ``slot``.
        """
        b = self._block[slot]
        if b is None:
            raise ValueError(f"slot {slot} holds no block")
        return HostEntry(b.block_hash, b.parent_hash or _ZERO_HASH, b.token_bytes, slot,
                         self._origin[slot] or self.medium, bool(self._on_disk[slot]), self._ready[slot])

    def blocks(self) -> Iterator[tuple[bytes, bytes | None]]:
        """``(block hash, parent hash or None for block 0)`` of every entry, oldest first."""
        blk = self._block
        for h, slot in self.entries.items():
            p = blk[slot].parent_hash
            yield h, (None if not p or p == _ZERO_HASH else p)

    def on_disk(self, slot: int) -> bool:
        return bool(self._on_disk[slot])

    def set_on_disk(self, slot: int, value: bool) -> None:
        """Record whether the block in ``slot`` has a disk copy (or one queued)."""
        self._on_disk[slot] = 1 if value else 0

    @property
    def used_bytes(self) -> int:
        """Bytes of slab held by entries (bytes)."""
        return len(self.entries) * self.codec.payload_bytes

    # -- LRU and pins ------------------------------------------------------------
    def touch(self, block_hash: bytes) -> None:
        """Mark an entry most recently used (no-op if absent)."""
        slot = self.entries.get(block_hash)
        if slot is not None:
            self.entries.move_to_end(block_hash)
            self._by_tenant[_tenant(self._block[slot])].move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Drop one pin; a slot with no owner and no pins becomes free.

        Raises:
            ValueError: the slot is not pinned.
        """
        if self._pins[slot] < 1:
            raise ValueError(f"slot {slot} is not pinned")
        self._pins[slot] -= 1
        if self._pins[slot] == 0 and self._owner[slot] is None:
            self._give_back(slot)

    def reserve(self, n: int, hold: Callable[[int], bool] | None = None, incoming: dict | None = None
                ) -> tuple[list[int], list[bytes], list[int]]:
        """Take up to ``n`` free slots, evicting unpinned LRU entries as needed.

        Args:
            n: slots wanted.
            incoming: tenant -> blocks of it about to be inserted into these slots; counted
                as that tenant's when eviction chooses between tenants (a tenant storing a
                batch is charged for it before another loses a block to it).
            hold: for the slot of an entry about to be evicted, True keeps the
                slot pinned (the caller still needs its bytes, e.g. to write it
                to disk and then :meth:`unpin` it); such a slot does not count
                towards ``n``. :meth:`view` still describes it.

        Returns:
            ``(slots, evicted, held)``: the slots (ascending; fewer than ``n``
            when every other slot is pinned or held), the hashes of every entry
            evicted, and the slots held.
        """
        evicted: list[bytes] = []
        held: list[int] = []
        free_after = len(self._free)
        if n > free_after:
            pins = self._pins
            victims = []
            if len(self._by_tenant) > 1 or any(t not in self._by_tenant for t in incoming or ()):
                # several tenants, counting the one storing now (alone: plain LRU)
                free_after = self._fair_victims(n, free_after, hold, victims, incoming or {})
            else:
                for h, slot in self.entries.items():  # oldest first
                    if free_after >= n:
                        break
                    if pins[slot]:
                        continue
                    keep = hold is not None and hold(slot)
                    victims.append((h, slot, keep))
                    if not keep:
                        free_after += 1
            entries, owner, blk = self.entries, self._owner, self._block
            for h, slot, keep in victims:
                del entries[h]
                self._drop_tenant_entry(_tenant(blk[slot]), h)
                owner[slot] = None
                evicted.append(h)
                if keep:
                    pins[slot] += 1
                    held.append(slot)
                else:
                    self._free.append(slot)
            if len(held) < len(victims):
                self._unsorted = True
        k = min(n, len(self._free))
        if self._unsorted:
            self._free.sort(reverse=True)
            self._unsorted = False
        slots = self._free[len(self._free) - k:][::-1]  # the k lowest, ascending
        del self._free[len(self._free) - k:]
        for s in slots:
            self._owner[s] = b""  # reserved, not yet owned by an entry
        return slots, evicted, held

    def _fair_victims(self, n: int, free_after: int, hold, victims: list, incoming: dict) -> int:
        """Pick victims (appended to ``victims``) until ``n`` slots would be free: each the
        oldest unpinned entry of the tenant with the most entries left, counting what each
        has ``incoming``. Returns the free count after them."""
        pins = self._pins
        left = {t: len(d) for t, d in self._by_tenant.items()}
        totals = {t: left.get(t, 0) + incoming.get(t, 0) for t in {*left, *incoming}}
        its = {t: iter(d.items()) for t, d in self._by_tenant.items()}
        while free_after < n:
            # the largest holder, counting what it is storing now (on a tie, one with entries)
            t = max(totals, key=lambda u: (totals[u], u in left))
            if t not in left:  # it has nothing (unpinned) left to give: nobody smaller loses
                break          # a block to it; the rest of its batch is not stored
            for h, slot in its[t]:
                if not pins[slot]:
                    break
            else:  # every remaining entry of this tenant is pinned
                del left[t]
                if incoming.get(t):  # the tenant storing now: nobody smaller loses a block to it
                    break
                del totals[t]  # pinned (being read or written): the next largest holder gives
                continue
            left[t] -= 1
            totals[t] -= 1
            keep = hold is not None and hold(slot)
            victims.append((h, slot, keep))
            if not keep:
                free_after += 1
        return free_after

    def _drop_tenant_entry(self, tenant: object, block_hash: bytes) -> None:
        d = self._by_tenant[tenant]
        del d[block_hash]
        if not d:
            del self._by_tenant[tenant]

    def tenant_of(self, slot: int) -> object:
        """The tenant of the block last stored in ``slot`` (None: none or unknown)."""
        return _tenant(self._block[slot]) if self._block[slot] is not None else None

    def entries_by_tenant(self) -> dict:
        """Entries held per tenant (``EvictedBlock.owner``; None: unknown)."""
        return {t: len(d) for t, d in self._by_tenant.items()}

    def release(self, slots: list[int]) -> None:
        """Give back reserved slots that were not used."""
        for s in slots:
            self._owner[s] = None
            if self._pins[s] == 0:
                self._give_back(s)

    def insert(self, block: BlockIdentity, slot: int, ready: object = None) -> None:
        """Add a block on a reserved slot, as most recently used.

        Raises:
            ValueError: the hash is present or the slot was not reserved.
        """
        self.insert_many([block], [slot], ready)

    def insert_many(self, blocks: Sequence[BlockIdentity], slots: Sequence[int], ready: object = None,
                    hashes: Sequence[bytes] | None = None, checked: bool = False, origin: str | None = None,
                    loss: Sequence[int] | None = None) -> None:
        """Add blocks on reserved slots (same order), most recently used last; nothing changes on error.

        Args:
            blocks: the blocks' identities (kept by reference).
            slots: reserved slots, one per block.
            ready: CUDA event of the copy into these slots (None on CPU).
            hashes: the blocks' hashes, when the caller has them at hand.
            checked: the caller guarantees the hashes are distinct and absent
                (skips those checks; the slot check still runs).
            origin: the medium these blocks are credited to when loaded, when
                not the tier's own (a staging area holds blocks from several).
            loss: per block, the loss rank of the KV stored (`kv_codec.loss_rank`;
                None: all exact); see :meth:`loss_rank`.

        Raises:
            ValueError: a hash is present or repeated, a slot was not reserved,
                or the lengths differ.
        """
        owner, index = self._owner, self.entries
        if hashes is None:
            hashes = [b.block_hash for b in blocks]
        if len(slots) != len(hashes) or (loss is not None and len(loss) != len(hashes)):
            raise ValueError(f"{len(hashes)} blocks for {len(slots)} slots" +
                             ("" if loss is None else f" and {len(loss)} loss ranks"))
        if not checked and (len(set(hashes)) != len(hashes) or not index.keys().isdisjoint(hashes)):
            raise ValueError("a block is already present or repeated")
        runs = list(_runs(slots))
        if any(owner[s0:s0 + k].count(b"") != k for s0, k, _ in runs):
            raise ValueError("a slot was not reserved")
        blk, on_disk, ready_of = self._block, self._on_disk, self._ready
        for s0, k, pos in runs:  # slice stores: one C-level copy per run of slots
            owner[s0:s0 + k] = hashes[pos:pos + k]
            blk[s0:s0 + k] = blocks[pos:pos + k]
            on_disk[s0:s0 + k] = bytes(k)
            self._loss[s0:s0 + k] = bytes(k) if loss is None else bytes(loss[pos:pos + k])
            if ready is not None or self._ready_used:
                ready_of[s0:s0 + k] = [ready] * k
            if origin is not None or self._origin_used:
                self._origin[s0:s0 + k] = [origin] * k
        if ready is not None:
            self._ready_used = True
        if origin is not None:
            self._origin_used = True
        index.update(zip(hashes, slots))
        by_tenant = self._by_tenant
        for b, h, slot in zip(blocks, hashes, slots):
            t = _tenant(b)
            d = by_tenant.get(t)
            if d is None:
                d = by_tenant[t] = OrderedDict()
            d[h] = slot

    _ready_used = False  # set once a CUDA event was stored (CPU pools skip the per-slot store)
    _origin_used = False  # set once an origin was given (only staging areas pay the per-slot store)

    def remove(self, block_hash: bytes) -> int | None:
        """Drop an entry; its slot is reused once it has no pins. Returns its slot, or None."""
        slot = self.entries.pop(block_hash, None)
        if slot is None:
            return None
        self._drop_tenant_entry(_tenant(self._block[slot]), block_hash)
        self._owner[slot] = None
        if self._pins[slot] == 0:
            self._give_back(slot)
        return slot

    def _give_back(self, slot: int) -> None:
        self._free.append(slot)
        self._unsorted = True

    def clear(self) -> list[bytes]:
        """Drop every entry (pinned slots are freed when unpinned); returns their hashes."""
        hashes = list(self.entries)
        for h in hashes:
            self.remove(h)
        return hashes

    # -- data movement -------------------------------------------------------------
    def store(self, kv_cache: torch.Tensor, block_ids: Sequence[int], slots: list[int]) -> torch.cuda.Event | None:
        """Copy pool blocks ``block_ids`` into slab rows ``slots`` (same order), encoding them.

        Args:
            kv_cache: the pool ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``.
            block_ids: pool rows to copy.
            slots: reserved slab rows, ascending.

        Returns:
            a CUDA event recorded after the copies when the pool is on a CUDA
            device (the copies are asynchronous; wait on it before reading the
            rows), else None.
        """
        if not block_ids:
            return None
        dev = kv_cache.device
        ids = torch.frombuffer(array.array("q", block_ids), dtype=torch.long).to(dev)
        exact_same_device = self.codec.exact and dev.type == "cpu"
        encoded = None
        if exact_same_device:
            rows = _flat_rows(kv_cache)
        else:
            encoded = self.codec.encode(kv_cache.index_select(0, ids))  # [n, P] on dev
        pos = 0
        for s0, k, _ in _runs(slots):
            dst = self.slab[s0:s0 + k]
            if exact_same_device:
                torch.index_select(rows, 0, ids[pos:pos + k], out=dst.view(rows.dtype))
            else:
                dst.copy_(encoded[pos:pos + k], non_blocking=dev.type == "cuda")
            pos += k
        if dev.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            return ev
        return None

    def load(self, kv_cache: torch.Tensor, slots: list[int], block_ids: list[int]) -> None:
        """Decode slab rows ``slots`` into pool blocks ``block_ids`` (same order)."""
        dev = kv_cache.device
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots_sorted = [slots[i] for i in order]
        ids_sorted = [block_ids[i] for i in order]
        exact_same_device = self.codec.exact and dev.type == "cpu"
        rows = _flat_rows(kv_cache) if exact_same_device else None
        pos = 0
        for s0, k, _ in _runs(slots_sorted):
            src = self.slab[s0:s0 + k]
            ids = torch.tensor(ids_sorted[pos:pos + k], dtype=torch.long, device=dev)
            if exact_same_device:
                rows.index_copy_(0, ids, src.view(rows.dtype))
            else:
                if dev.type == "cuda":
                    src = src.to(dev, non_blocking=True)
                kv_cache.index_copy_(0, ids, self.codec.decode(src))
            pos += k

    def payload(self, slot: int) -> torch.Tensor:
        """Slab row ``slot``: ``[payload_bytes]`` uint8 (a view)."""
        return self.slab[slot]

    def payload_bytes_view(self, slot: int) -> memoryview:
        """Slab row ``slot`` as a zero-copy memoryview of ``payload_bytes`` bytes."""
        p = self.codec.payload_bytes
        return self._slab_mv[slot * p:(slot + 1) * p]


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool as ``[num_blocks, values per block]`` in its own dtype (a view; the pool is
    contiguous). Gathers of these rows run at memcpy speed; as uint8 they are slower."""
    return kv_cache.view(kv_cache.shape[0], -1)


def _runs(slots: Sequence[int]):
    """``(start, length, position)`` of each run of consecutive values in a list (any order)."""
    n = len(slots)
    if n and slots[-1] - slots[0] == n - 1 and list(slots) == list(range(slots[0], slots[0] + n)):
        yield slots[0], n, 0  # one run (the usual case)
        return
    i = 0
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        yield slots[i], j - i, i
        i = j
