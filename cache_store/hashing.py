"""Chained block hashing for prefix caching.

A token sequence is cut into fixed-size blocks of ``block_size`` tokens. The
hash of block ``i`` covers the token ids of that block and the hash of block
``i - 1``; the parent of block 0 is the root hash of a :class:`Namespace`
(model, cache salt, adapter). Two sequences therefore share a block hash only
if they share the whole prefix up to and including that block, in the same
namespace. The chaining scheme follows vLLM's automatic prefix caching design
doc; the hash function is XXH3 with a 128-bit digest (xxh3_128, Yann Collet),
as exposed by the ``xxhash`` package. Python's built-in ``hash()`` is never
used, so hashes are stable across processes and ``PYTHONHASHSEED`` values.

Byte formats (``HASH_FORMAT_VERSION`` 1):

* token bytes: each token id as an unsigned 32-bit little-endian integer;
* namespace root: ``xxh3_128`` digest of ``msgpack.packb(["kvmesh.block_hash",
  version, model_id, cache_salt, adapter_id])`` (msgpack spec, str and int
  types, ``use_bin_type`` default of msgpack-python 1.x); with a non-empty
  tenant id the list gets it as a sixth item (``[..., adapter_id, tenant]``), so
  no salt of one tenant can produce another tenant's root;
* block hash: ``xxh3_128`` digest of ``parent_hash + block_token_bytes``.

Every digest is the 16-byte big-endian canonical form produced by
``xxhash.xxh3_128_digest``.
"""

from __future__ import annotations

import os
import sys
from array import array
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import msgpack
import numpy as np
import xxhash

__all__ = [
    "HASH_FORMAT_VERSION",
    "HASH_BYTES",
    "Namespace",
    "tokens_to_bytes",
    "hash_block",
    "BlockHashes",
    "hash_blocks",
]

HASH_FORMAT_VERSION: int = 1
HASH_BYTES = 16

_ROOT_TAG = "kvmesh.block_hash"
_TOKEN_LIMIT = 1 << 32
_xxh3_128_digest = xxhash.xxh3_128_digest

# array("I") is the fastest way from a list of ints to packed uint32 bytes,
# and it rejects out-of-range values by itself. Its item is a C unsigned int
# in native order, so it is only used where that is 4 little-endian bytes.
_ARRAY_U32_OK = array("I").itemsize == 4 and sys.byteorder == "little"

try:  # C loop over the same definition (cache_store/_chainhash.c); optional at install time
    from kvmesh.cache_store import _chainhash
except ImportError:  # pragma: no cover - exercised where libxxhash-dev is absent
    _chainhash = None

#: True when the C extension is in use (``KVMESH_PURE_PYTHON_HASH=1`` turns it off).
NATIVE_HASHING = _chainhash is not None and os.environ.get("KVMESH_PURE_PYTHON_HASH", "") not in ("1", "true")


@dataclass(frozen=True)
class Namespace:
    """The scope block hashes live in: one model, tenant salt and adapter.

    Different namespaces yield unrelated root hashes and hence disjoint block
    hashes for identical token ids.

    Attributes:
        model_id: model name or path; must be non-empty.
        cache_salt: cache salt chosen by the request; "" for the tenant's whole space.
        adapter_id: LoRA adapter id; "" for the base model.
        version: hash format version, ``HASH_FORMAT_VERSION`` by default.
        tenant: tenant id resolved by the server from credentials
            (`kvmesh.services.auth`); "" in the open, single-tenant mode.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: ``model_id`` is empty or ``version`` is negative.
    """

    model_id: str
    cache_salt: str = ""
    adapter_id: str = ""
    version: int = HASH_FORMAT_VERSION
    tenant: str = ""
    _root: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        for name in ("model_id", "cache_salt", "adapter_id", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Namespace.{name} must be str")
        if not isinstance(self.version, int) or isinstance(self.version, bool):
            raise TypeError("Namespace.version must be int")
        if not self.model_id:
            raise ValueError("Namespace.model_id must be non-empty")
        if self.version < 0:
            raise ValueError("Namespace.version must be >= 0")
        fields = [_ROOT_TAG, self.version, self.model_id, self.cache_salt, self.adapter_id]
        if self.tenant:
            fields.append(self.tenant)
        packed = msgpack.packb(fields)
        object.__setattr__(self, "_root", _xxh3_128_digest(packed))

    def root_hash(self) -> bytes:
        """The 16-byte parent hash of block 0 in this namespace (computed once)."""
        return self._root


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as unsigned 32-bit little-endian integers.

    Args:
        token_ids: a sequence (or 1-D integer numpy array) of token ids.

    Returns:
        ``4 * len(token_ids)`` bytes.

    Raises:
        ValueError: an id is < 0 or >= 2**32, or the array is not 1-D.
        TypeError: an id is not an integer.
    """
    if isinstance(token_ids, np.ndarray):
        return _ndarray_to_bytes(token_ids)
    if NATIVE_HASHING and isinstance(token_ids, (list, tuple)):
        return _chainhash.pack_u32(token_ids)
    if _ARRAY_U32_OK:
        try:
            return array("I", token_ids).tobytes()
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
    return _ndarray_to_bytes(np.asarray(list(token_ids)))


def _ndarray_to_bytes(arr: np.ndarray) -> bytes:
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    kind = arr.dtype.kind
    if kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize > 4 or kind == "i":
        if int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT:
            raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def hash_block(parent_hash: bytes, block_token_bytes: bytes) -> bytes:
    """Hash one block: 16-byte xxh3_128 digest of ``parent_hash + block_token_bytes``."""
    return _xxh3_128_digest(parent_hash + block_token_bytes)


class BlockHashes(NamedTuple):
    """Hashes of the full blocks of one token sequence.

    Attributes:
        hashes: one 16-byte hash per full block, block 0 first.
        token_bytes: ``tokens_to_bytes`` of all token ids given, the partial
            tail block (if any) included.
        block_size: tokens per block.
    """

    hashes: list[bytes]
    token_bytes: bytes
    block_size: int

    def block_tokens(self, i: int) -> bytes:
        """Token bytes (``4 * block_size`` bytes) of full block ``i``.

        Raises:
            IndexError: ``i`` is not the index of a full block.
        """
        if not 0 <= i < len(self.hashes):
            raise IndexError(f"block {i} out of range [0, {len(self.hashes)})")
        step = self.block_size * 4
        return self.token_bytes[i * step : (i + 1) * step]

    @property
    def num_tokens(self) -> int:
        """Number of token ids given, partial tail included (tokens)."""
        return len(self.token_bytes) // 4


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent_hash: bytes,
    hash_fn: Callable[[bytes, bytes], bytes] = hash_block,
) -> BlockHashes:
    """Chain-hash the full blocks of a token sequence.

    Args:
        token_ids: the sequence's token ids (ints in [0, 2**32)).
        block_size: tokens per block, > 0.
        parent_hash: hash of the block before the first one given: the
            namespace root hash when ``token_ids`` starts the sequence, or the
            last full block's hash when extending an already hashed sequence.
        hash_fn: ``(parent_hash, block_token_bytes) -> bytes``; tests inject a
            weak one to provoke collisions.

    Returns:
        ``BlockHashes`` with ``len(token_ids) // block_size`` hashes; the
        partial tail is kept in ``token_bytes`` but not hashed.

    Raises:
        ValueError: ``block_size`` < 1, or a token id out of range.
        TypeError: a token id is not an integer, or ``parent_hash`` is not bytes.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(parent_hash, bytes):
        raise TypeError("parent_hash must be bytes")
    tb = tokens_to_bytes(token_ids)
    step = block_size * 4
    stop = len(tb) - step + 1
    h = parent_hash
    if hash_fn is hash_block and NATIVE_HASHING:
        hashes = _chainhash.chain_hash(tb, block_size, h)
    elif hash_fn is hash_block:
        d = _xxh3_128_digest
        hashes = [h := d(h + tb[o : o + step]) for o in range(0, stop, step)]
    else:
        f = hash_fn
        hashes = [h := f(h, tb[o : o + step]) for o in range(0, stop, step)]
    return BlockHashes(hashes, tb, block_size)
