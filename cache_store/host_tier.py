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
once unpinned. Not thread-safe: :class:`cache_store.tier_store.TierStore`
serializes access under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from cache_store.kv_codec import KVCodec

__all__ = ["HostEntry", "HostTier"]


@dataclass(slots=True, eq=False)
class HostEntry:
    """One block in the host tier.

    Attributes:
        block_hash: 16-byte chained hash.
        parent_hash: previous block's hash, ``ZERO_HASH`` for block 0.
        token_bytes: the block's token ids as little-endian uint32.
        slot: slab row holding the payload.
        origin: medium the block is credited to when loaded: the tier's
            medium, or ``"peer"`` for blocks staged by a peer fetch.
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
        self.num_slots = self.capacity_bytes // codec.payload_bytes
        pin = bool(pin_memory and torch.cuda.is_available())
        self.slab = torch.empty((max(self.num_slots, 1), codec.payload_bytes), dtype=torch.uint8, pin_memory=pin)
        self._slab_np = self.slab.numpy()  # one zero-copy view; per-row Tensor.numpy() is slow
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))  # free slots; sorted descending when not _unsorted
        self._unsorted = False
        self._owner: list[bytes | None] = [None] * self.num_slots
        self._pins = [0] * self.num_slots

    # -- queries ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: bytes) -> HostEntry | None:
        return self.entries.get(block_hash)

    @property
    def used_bytes(self) -> int:
        """Bytes of slab held by entries (bytes)."""
        return len(self.entries) * self.codec.payload_bytes

    # -- LRU and pins ------------------------------------------------------------
    def touch(self, block_hash: bytes) -> None:
        """Mark an entry most recently used (no-op if absent)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

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

    def reserve(self, n: int, hold: Callable[[HostEntry], bool] | None = None
                ) -> tuple[list[int], list[HostEntry], list[HostEntry]]:
        """Take up to ``n`` free slots, evicting unpinned LRU entries as needed.

        Args:
            n: slots wanted.
            hold: for an entry about to be evicted, True keeps its slot pinned
                (the caller still needs its bytes, e.g. to write it to disk
                and then :meth:`unpin` it); such a slot does not count
                towards ``n``.

        Returns:
            ``(slots, evicted, held)``: the slots (ascending; fewer than ``n``
            when every other slot is pinned or held), every entry evicted, and
            the evicted entries whose slots were held.
        """
        evicted: list[HostEntry] = []
        held: list[HostEntry] = []
        free_after = len(self._free)
        if n > free_after:
            victims = []
            for e in self.entries.values():  # oldest first
                if free_after >= n:
                    break
                if self._pins[e.slot]:
                    continue
                keep = hold is not None and hold(e)
                victims.append((e, keep))
                if not keep:
                    free_after += 1
            for e, keep in victims:
                if keep:
                    self.pin(e.slot)
                    held.append(e)
                evicted.append(self.remove(e.block_hash))
        k = min(n, len(self._free))
        if self._unsorted:
            self._free.sort(reverse=True)
            self._unsorted = False
        slots = self._free[len(self._free) - k:][::-1]  # the k lowest, ascending
        del self._free[len(self._free) - k:]
        for s in slots:
            self._owner[s] = b""  # reserved, not yet owned by an entry
        return slots, evicted, held

    def release(self, slots: list[int]) -> None:
        """Give back reserved slots that were not used."""
        for s in slots:
            self._owner[s] = None
            if self._pins[s] == 0:
                self._give_back(s)

    def insert(self, entry: HostEntry) -> None:
        """Add an entry on a reserved slot, as most recently used.

        Raises:
            ValueError: the hash is present or the slot was not reserved.
        """
        if entry.block_hash in self.entries:
            raise ValueError("block already in the host tier")
        if self._owner[entry.slot] != b"":
            raise ValueError(f"slot {entry.slot} was not reserved")
        self._owner[entry.slot] = entry.block_hash
        self.entries[entry.block_hash] = entry

    def insert_many(self, entries: list[HostEntry]) -> None:
        """:meth:`insert` for a batch (same checks, one call; nothing changes on error).

        Raises:
            ValueError: a hash is present or repeated, or a slot was not reserved.
        """
        owner, index = self._owner, self.entries
        hashes = [e.block_hash for e in entries]
        slots = [e.slot for e in entries]
        if (len(set(hashes)) != len(hashes) or not index.keys().isdisjoint(hashes)
                or not all(map(b"".__eq__, map(owner.__getitem__, slots)))):
            raise ValueError("a block is already present, or a slot was not reserved")
        for slot, h in zip(slots, hashes):
            owner[slot] = h
        index.update(zip(hashes, entries))

    def remove(self, block_hash: bytes) -> HostEntry | None:
        """Drop an entry; its slot is reused once it has no pins. Returns it, or None."""
        e = self.entries.pop(block_hash, None)
        if e is None:
            return None
        self._owner[e.slot] = None
        if self._pins[e.slot] == 0:
            self._give_back(e.slot)
        return e

    def _give_back(self, slot: int) -> None:
        self._free.append(slot)
        self._unsorted = True

    def clear(self) -> list[HostEntry]:
        """Drop every entry (pinned slots are freed when unpinned); returns them."""
        out = [self.remove(h) for h in list(self.entries)]
        return [e for e in out if e is not None]

    # -- data movement -------------------------------------------------------------
    def store(self, kv_cache: torch.Tensor, block_ids: list[int], slots: list[int]) -> torch.cuda.Event | None:
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
        ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
        exact_same_device = self.codec.exact and dev.type == "cpu"
        encoded = None
        if exact_same_device:
            rows = _flat_rows(kv_cache)
        else:
            encoded = self.codec.encode(kv_cache.index_select(0, ids))  # [n, P] on dev
        pos = 0
        for s0, k in _runs(slots):
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
        for s0, k in _runs(slots_sorted):
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
        return memoryview(self._slab_np[slot])


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool as ``[num_blocks, values per block]`` in its own dtype (a view; the pool is
    contiguous). Gathers of these rows run at memcpy speed; as uint8 they are slower."""
    return kv_cache.view(kv_cache.shape[0], -1)


def _runs(sorted_slots: list[int]):
    """``(start, length)`` of each run of consecutive values in an ascending list."""
    n = len(sorted_slots)
    if n and sorted_slots[-1] - sorted_slots[0] == n - 1:  # one run (the usual case)
        yield sorted_slots[0], n
        return
    i = 0
    while i < n:
        j = i + 1
        while j < n and sorted_slots[j] == sorted_slots[j - 1] + 1:
            j += 1
        yield sorted_slots[i], j - i
        i = j
