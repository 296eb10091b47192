"""A radix tree over chained block hashes.

Each node stands for one full block: its 16-byte chained hash, the node of
the block before it (the root for block 0), the block's token bytes and a
payload (a block id on a worker, anything elsewhere). Because a block hash
already encodes the whole prefix (see :mod:`cache_store.hashing`), every edge
is exactly one block. Blocks as the caching unit follow vLLM's automatic
prefix caching; the tree follows SGLang's RadixAttention (Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs") with a
page size of one block.

Lookups walk the tree from the root and, where the caller supplies token
bytes, compare them with the stored ones: a hash collision (two different
prefixes with the same hash) then ends the match instead of handing one
sequence another's KV. A hash is stored at most once; a colliding insert is
refused, never overwrites.

Besides the structure itself the index keeps an LRU order of its leaves (a
lazy min-heap keyed by a logical access clock), used where the index is the
cache's only bookkeeping (simulator, host tier).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from kvmesh.cache_store.hashing import BlockHashes

__all__ = ["MatchResult", "RadixNode", "RadixIndex"]

TokenSource = Callable[[int], bytes] | Sequence[bytes] | None


class MatchResult(NamedTuple):
    """Result of :meth:`RadixIndex.match`.

    Attributes:
        values: payloads of the matched blocks, root-first.
        num_blocks: ``len(values)``.
    """

    values: list
    num_blocks: int


@dataclass(slots=True, eq=False)
class RadixNode:
    """One cached block. ``block_hash`` and ``parent`` are None only at the root."""

    block_hash: bytes | None
    parent: RadixNode | None
    children: dict
    tokens: bytes | None
    value: Any
    depth: int
    last_access: int

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash else "root"
        return f"RadixNode({h}, depth={self.depth}, value={self.value!r}, children={len(self.children)})"


def _token_getter(block_tokens: TokenSource) -> Callable[[int], bytes] | None:
    if block_tokens is None:
        return None
    if callable(block_tokens):
        return block_tokens
    return block_tokens.__getitem__


def _token_buffer(block_tokens: TokenSource) -> tuple[bytes, int] | None:
    """``(token_bytes, bytes per block)`` when ``block_tokens`` is a ``BlockHashes.block_tokens``.

    Lets the hot loops slice the buffer instead of calling the method.
    """
    owner = getattr(block_tokens, "__self__", None)
    if isinstance(owner, BlockHashes) and getattr(block_tokens, "__func__", None) is BlockHashes.block_tokens:
        return owner.token_bytes, owner.block_size * 4
    return None


class RadixIndex:
    """Block-hash radix tree with collision-safe lookups and a leaf LRU.

    All methods are O(blocks touched); nothing does I/O.
    """

    __slots__ = ("_root", "_nodes", "_heap", "_clock")

    def __init__(self) -> None:
        self._root = RadixNode(None, None, {}, None, None, 0, 0)
        self._nodes: dict[bytes, RadixNode] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._clock = 0

    # -- queries -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._nodes

    def get(self, block_hash: bytes) -> Any:
        """Payload stored for ``block_hash``, or None if absent."""
        n = self._nodes.get(block_hash)
        return None if n is None else n.value

    def node(self, block_hash: bytes) -> RadixNode | None:
        """The node for ``block_hash`` (read-only use), or None."""
        return self._nodes.get(block_hash)

    def items(self) -> Iterator[tuple[bytes, Any]]:
        """``(hash, payload)`` of every node, in no particular order."""
        return ((h, n.value) for h, n in self._nodes.items())

    def is_leaf(self, block_hash: bytes) -> bool:
        """True if the hash is present and has no children. KeyError if absent."""
        return not self._nodes[block_hash].children

    def match(self, block_hashes: Sequence[bytes], block_tokens: TokenSource = None) -> MatchResult:
        """Longest cached prefix of a sequence.

        Args:
            block_hashes: the sequence's block hashes, block 0 first.
            block_tokens: token bytes of block ``i`` as ``block_tokens(i)`` or
                ``block_tokens[i]``; None skips the token check.

        Returns:
            payloads of blocks ``0 .. k-1`` where ``k`` is the first block
            that is absent, not a child of block ``k-1``'s node, or (when
            tokens are given) stored with different token bytes. Does not
            change the LRU order; call :meth:`touch` for that.
        """
        values: list = []
        append = values.append
        node = self._root
        get_tok = _token_getter(block_tokens)
        buf = _token_buffer(block_tokens)
        if get_tok is None:
            for h in block_hashes:
                node = node.children.get(h)
                if node is None:
                    break
                append(node.value)
        elif buf is not None:
            tb, step = buf
            o = 0
            for h in block_hashes:
                node = node.children.get(h)
                if node is None or node.tokens != tb[o : o + step]:
                    break
                append(node.value)
                o += step
        else:
            i = 0
            for h in block_hashes:
                node = node.children.get(h)
                if node is None or node.tokens != get_tok(i):
                    break
                append(node.value)
                i += 1
        return MatchResult(values, len(values))

    # -- updates -------------------------------------------------------------
    def insert(
        self,
        block_hashes: Sequence[bytes],
        block_tokens: TokenSource,
        values: Sequence[Any],
        start: int = 0,
        end: int | None = None,
    ) -> list[int]:
        """Insert blocks ``start .. end-1`` of a sequence below its blocks ``0 .. start-1``.

        Blocks ``0 .. start-1`` must already be present as a chain from the
        root (with equal token bytes where given); this is verified, O(start).
        A block already present under the same parent with equal token bytes
        (or any, when ``block_tokens`` is None) is kept as is (payload unchanged) and insertion goes on below it. A
        block whose hash is present elsewhere or with other token bytes is a
        collision: it is not overwritten and insertion stops there.

        Args:
            block_hashes: the sequence's block hashes, block 0 first.
            block_tokens: as for :meth:`match`; None skips token checks and
                stores no token bytes (such nodes never pass a lookup that
                does give tokens).
            values: payload of block ``i`` is ``values[i]``.
            start: first block to insert.
            end: one past the last block to insert; ``len(block_hashes)`` if None.

        Returns:
            indices of the blocks that were newly inserted, ascending.

        Raises:
            ValueError: bad range, too few values, or blocks ``0 .. start-1``
                are not present as a chain.
        """
        end = self._check_range(block_hashes, values, start, end)
        get_tok = _token_getter(block_tokens)
        node = self._root
        for i in range(start):
            node = node.children.get(block_hashes[i])
            if node is None or (get_tok is not None and node.tokens != get_tok(i)):
                raise ValueError(f"blocks 0..{start - 1} are not cached as a chain (block {i})")
        return self._insert_below(node, block_hashes, block_tokens, values, start, end)

    def extend(
        self,
        block_hashes: Sequence[bytes],
        block_tokens: TokenSource,
        values: Sequence[Any],
        start: int,
        end: int | None = None,
    ) -> list[int]:
        """Like :meth:`insert`, but trusts the chain above ``start``: O(end - start).

        The node for ``block_hashes[start-1]`` must exist at depth ``start``;
        the caller vouches that it is this sequence's block ``start-1`` (for
        instance because its payload is a block the caller itself
        registered). Use it for block-by-block growth during decoding.

        Raises:
            ValueError: bad range, too few values, or no node for block
                ``start-1`` at that depth.
        """
        end = self._check_range(block_hashes, values, start, end)
        if start == 0:
            node = self._root
        else:
            node = self._nodes.get(block_hashes[start - 1])
            if node is None or node.depth != start:
                raise ValueError(f"block {start - 1} is not cached at depth {start}")
        return self._insert_below(node, block_hashes, block_tokens, values, start, end)

    @staticmethod
    def _check_range(block_hashes: Sequence[bytes], values: Sequence[Any], start: int, end: int | None) -> int:
        n = len(block_hashes)
        if end is None:
            end = n
        if not 0 <= start <= end <= n:
            raise ValueError(f"bad block range [{start}, {end}) for {n} blocks")
        if len(values) < end:
            raise ValueError(f"{len(values)} values for blocks up to {end}")
        return end

    def _insert_below(
        self,
        node: RadixNode,
        block_hashes: Sequence[bytes],
        block_tokens: TokenSource,
        values: Sequence[Any],
        start: int,
        end: int,
    ) -> list[int]:
        nodes = self._nodes
        inserted: list[int] = []
        clock = self._clock
        get_tok = _token_getter(block_tokens)
        buf = _token_buffer(block_tokens)
        tb, step = buf if buf is not None else (b"", 0)
        for i in range(start, end):
            h = block_hashes[i]
            if buf is not None:
                tok = tb[i * step : (i + 1) * step]
            else:
                tok = None if get_tok is None else get_tok(i)
            old = nodes.get(h)
            if old is not None:
                if old.parent is node and (tok is None or old.tokens == tok):
                    node = old
                    continue
                break  # collision: keep what is cached, stop here
            clock += 1
            child = RadixNode(h, node, {}, tok, values[i], node.depth + 1, clock)
            node.children[h] = child
            nodes[h] = child
            inserted.append(i)
            node = child
        self._clock = clock
        if inserted and not node.children:
            self._push(node)
        return inserted

    def set_value(self, block_hash: bytes, value: Any) -> Any:
        """Store ``value`` as the payload of a present block (its place in the tree, children
        and LRU position unchanged). Returns the payload it replaces. KeyError if absent."""
        node = self._nodes[block_hash]
        old, node.value = node.value, value
        return old

    def remove(self, block_hash: bytes) -> list:
        """Remove a block and, if it has any, its whole subtree.

        Returns:
            payloads removed, the block's own first; [] for an unknown hash.
        """
        node = self._nodes.get(block_hash)
        if node is None:
            return []
        parent = node.parent
        del parent.children[block_hash]
        nodes = self._nodes
        out = []
        stack = [node]
        while stack:
            n = stack.pop()
            del nodes[n.block_hash]
            out.append(n.value)
            if n.children:
                stack.extend(n.children.values())
                n.children = {}
            n.parent = None
        if parent is not self._root and not parent.children:
            self._push(parent)
        return out

    def touch(self, block_hashes: Iterator[bytes] | Sequence[bytes]) -> None:
        """Mark blocks as just used, in the order given (pass them root-first).

        Unknown hashes are ignored.
        """
        nodes = self._nodes
        for h in block_hashes:
            n = nodes.get(h)
            if n is not None:
                self._clock += 1
                n.last_access = self._clock
                if not n.children:
                    self._push(n)

    def pop_lru_leaf(self, can_evict: Callable[[Any], bool] = lambda v: True) -> tuple[bytes, Any] | None:
        """Remove the least recently used leaf whose payload passes ``can_evict``.

        Returns:
            ``(hash, payload)`` of the removed leaf, or None if no leaf passes.
        """
        heap = self._heap
        nodes = self._nodes
        skipped = []
        found = None
        while heap:
            tick, h = heapq.heappop(heap)
            n = nodes.get(h)
            if n is None or n.last_access != tick or n.children:
                continue  # stale entry
            if not can_evict(n.value):
                skipped.append((tick, h))
                continue
            found = (h, n.value)
            self.remove(h)
            break
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def evict_lru_leaf(self, can_evict: Callable[[Any], bool] = lambda v: True) -> Any:
        """Remove the least recently used evictable leaf; return its payload or None."""
        found = self.pop_lru_leaf(can_evict)
        return None if found is None else found[1]

    def _push(self, node: RadixNode) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._nodes) + 64:
            heap[:] = [(n.last_access, h) for h, n in self._nodes.items() if not n.children]
            heapq.heapify(heap)
            return  # the rebuild already holds every leaf, ``node`` included
        heapq.heappush(heap, (node.last_access, node.block_hash))

    def clear(self) -> None:
        """Remove every block."""
        for n in self._nodes.values():
            n.parent = None
            n.children = {}
        self._root.children = {}
        self._nodes = {}
        self._heap = []

    def check_integrity(self) -> None:
        """Verify parent/child links, depths and the hash map.

        Raises:
            RuntimeError: describing every inconsistency found.
        """
        errors = []
        reached = 0
        stack = [self._root]
        while stack:
            n = stack.pop()
            for h, c in n.children.items():
                reached += 1
                if c.block_hash != h:
                    errors.append(f"child keyed {h.hex()} has hash {c.block_hash!r}")
                if c.parent is not n:
                    errors.append(f"{h.hex()}: parent link broken")
                if c.depth != n.depth + 1:
                    errors.append(f"{h.hex()}: depth {c.depth} under depth {n.depth}")
                if self._nodes.get(h) is not c:
                    errors.append(f"{h.hex()}: not in the hash map")
                stack.append(c)
        if reached != len(self._nodes):
            errors.append(f"{reached} nodes reachable, {len(self._nodes)} in the hash map")
        if errors:
            raise RuntimeError("RadixIndex integrity: " + "; ".join(errors))
