"""vLLM's prefix-caching block hashes, computed outside vLLM.

A router in front of vLLM servers learns what each one caches from its KV events
(`services.vllm_events`), whose ``BlockStored`` events name blocks by vLLM's own block
hashes. To ask "which server holds this request's prefix?" the router must hash the
request's tokens exactly as that vLLM version does. This module does that for the
versions listed in :data:`SUPPORTED_VERSIONS` and refuses the others.

The format followed (vLLM 0.32, ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``; prefix caching in vLLM's V1 engine):

* A request's tokens are split into full blocks of ``block_size`` tokens (the last
  partial block is never hashed). Block ``i``'s hash is
  ``H((parent, tuple(token_ids of block i), extra_keys))`` where ``parent`` is block
  ``i - 1``'s hash, and for block 0 the seed hash ``NONE_HASH = H(seed)``.
* ``H`` is the server's ``--prefix-caching-hash-algo``: ``sha256`` (the default) and
  ``xxhash`` serialize with :func:`pickle.dumps` at the highest protocol, then take
  SHA-256 (32 bytes) or xxh3-128 (16 bytes); ``sha256_cbor`` and ``xxhash_cbor``
  serialize with canonical CBOR (``cbor2``) instead.
* ``seed`` is the server's ``PYTHONHASHSEED`` when set, else the string
  ``"vllm-none-hash"`` for the SHA-256 algorithms. For the xxhash algorithms without
  ``PYTHONHASHSEED`` vLLM draws a random seed per process, which no outside party can
  reproduce: this module refuses that configuration.
* ``extra_keys`` is None unless the request carries one of: a LoRA adapter
  (``("lora", name, path)``, every block), a cache salt (``("cache_salt", salt)``,
  block 0 only), multi-modal inputs or prompt embeddings (not supported here: their
  keys depend on processor outputs a router does not have).
* KV events carry, by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), each hash as
  the integer of its last 8 bytes (big-endian); with that variable set to 0, the
  whole digest as bytes. :meth:`VllmHasher.event_key` maps both to the same index key.

The result is validated against vLLM itself by ``tests/test_vllm_compat.py`` (vLLM's
own hashing functions in vLLM's virtualenv) and against the events a live server
publishes (``tests/test_vllm_e2e.py``).
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import xxhash

__all__ = [
    "SUPPORTED_VERSIONS",
    "HASH_ALGOS",
    "DEFAULT_SEED",
    "UnsupportedVllm",
    "VllmHashConfig",
    "VllmHasher",
    "check_version",
    "event_key",
]

#: vLLM releases whose block hashing this module reproduces (checked by the tests).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32.0",)
#: Values of vLLM's ``--prefix-caching-hash-algo``.
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's seed of ``NONE_HASH`` for the SHA-256 algorithms when ``PYTHONHASHSEED`` is unset.
DEFAULT_SEED = "vllm-none-hash"
#: Bytes of a block hash as published in KV events with integer hashes (vLLM's default).
INT_HASH_BYTES = 8


class UnsupportedVllm(ValueError):
    """The vLLM version or hash configuration cannot be reproduced here.

    The message names the setting to change (a vLLM flag, an environment variable of
    the vLLM server, or a kvmesh ``--vllm-*`` flag).
    """


def check_version(version: str) -> str:
    """Return ``version`` if its block hashing is reproduced here.

    Raises:
        UnsupportedVllm: any other version (the message lists the supported ones).
    """
    base = version.split("+", 1)[0].strip()
    if base not in SUPPORTED_VERSIONS:
        raise UnsupportedVllm(
            f"vLLM {version!r} is not supported: kvmesh reproduces the prefix-caching block hashes of vLLM "
            f"{', '.join(SUPPORTED_VERSIONS)} only (another version may hash differently and every lookup would "
            f"miss). Run a supported vLLM, or pass --vllm-version to state it if the server hides /version")
    return base


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError:  # pragma: no cover - cbor2 is a dependency
        raise UnsupportedVllm("the *_cbor hash algorithms need the cbor2 package: pip install cbor2") from None
    return cbor2.dumps(obj, canonical=True)


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickle_bytes(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(_cbor_bytes(obj)).digest(),
    "xxhash": lambda obj: xxhash.xxh3_128_digest(_pickle_bytes(obj)),
    "xxhash_cbor": lambda obj: xxhash.xxh3_128_digest(_cbor_bytes(obj)),
}


@dataclass(frozen=True, slots=True)
class VllmHashConfig:
    """How the vLLM servers behind one router hash blocks; all of them must agree.

    Attributes:
        version: the servers' vLLM version (one of :data:`SUPPORTED_VERSIONS`).
        block_size: the servers' ``--block-size`` (tokens per block; 32 on vLLM's CPU
            backend, 16 by default on CUDA).
        hash_algo: the servers' ``--prefix-caching-hash-algo`` (one of :data:`HASH_ALGOS`).
        hash_seed: the servers' ``PYTHONHASHSEED``; None when it is unset.
        int_block_hashes: the servers' ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (vLLM's
            default True: events carry 64-bit integer hashes).

    Raises:
        UnsupportedVllm: an unsupported version or algorithm, a block size < 1, or an
            xxhash algorithm without a seed (vLLM then seeds each process at random).
    """

    version: str = SUPPORTED_VERSIONS[-1]
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    int_block_hashes: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", check_version(self.version))
        if self.hash_algo not in HASH_ALGOS:
            raise UnsupportedVllm(f"--vllm-hash-algo {self.hash_algo!r} is not one of vLLM's prefix-caching hash "
                                  f"algorithms: {', '.join(HASH_ALGOS)}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise UnsupportedVllm(f"--vllm-block-size must be a positive number of tokens, got {self.block_size!r}")
        if self.hash_algo.startswith("xxhash") and self.hash_seed is None:
            raise UnsupportedVllm(
                f"vLLM seeds {self.hash_algo} block hashes with a random per-process value unless PYTHONHASHSEED "
                f"is set, so no router can reproduce them: start every vLLM server with the same PYTHONHASHSEED "
                f"and pass it as --vllm-hash-seed, or use --prefix-caching-hash-algo sha256")


class VllmHasher:
    """Computes a request's block hashes as the configured vLLM does. Pure; thread-safe.

    Args:
        config: the servers' hashing settings.
    """

    def __init__(self, config: VllmHashConfig):
        self.config = config
        self._fn = _HASH_FNS[config.hash_algo]
        seed = config.hash_seed if config.hash_seed is not None else DEFAULT_SEED
        #: vLLM's ``NONE_HASH``: the parent of every request's first block.
        self.none_hash: bytes = self._fn(seed)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int],
                   extra_keys: tuple | None = None) -> bytes:
        """One block's hash: ``H((parent or NONE_HASH, tuple(token_ids), extra_keys))``.

        Args:
            parent: the previous block's digest, None for a first block.
            token_ids: the block's ``block_size`` token ids.
            extra_keys: vLLM's tagged extra keys of this block, or None.

        Returns:
            The digest (32 bytes for the SHA-256 algorithms, 16 for xxhash).
        """
        return self._fn((parent if parent else self.none_hash, tuple(int(t) for t in token_ids), extra_keys))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora: tuple[str, str] | None = None) -> list[bytes]:
        """Digests of every full block of a prompt, first block first.

        Args:
            token_ids: the prompt's token ids (``[num_tokens]``); the trailing partial
                block, if any, is not hashed.
            cache_salt: the request's ``cache_salt`` (vLLM's request field), or None/"".
            lora: ``(lora_name, lora_path)`` of the request's adapter, or None.

        Returns:
            ``num_tokens // block_size`` digests.
        """
        bs = self.config.block_size
        out: list[bytes] = []
        parent: bytes | None = None
        lora_keys = [("lora", lora[0], lora[1])] if lora else []
        for start in range(0, len(token_ids) - bs + 1, bs):
            keys = list(lora_keys)
            if start == 0 and cache_salt:
                keys.append(("cache_salt", cache_salt))
            parent = self.hash_block(parent, token_ids[start:start + bs], tuple(keys) if keys else None)
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None,
             lora: tuple[str, str] | None = None) -> list[bytes]:
        """The index keys (:func:`event_key` form) of a prompt's full blocks, first block first."""
        return [self.digest_key(h) for h in self.block_hashes(token_ids, cache_salt, lora)]

    def digest_key(self, digest: bytes) -> bytes:
        """The index key of one of our digests, in the form the servers' events use."""
        return digest[-INT_HASH_BYTES:] if self.config.int_block_hashes else digest


def event_key(h: int | bytes) -> bytes:
    """The index key of a hash as it appears in a vLLM KV event.

    An integer hash (vLLM's default) becomes its 8 big-endian bytes, which equal the last
    8 bytes of the digest it came from; a bytes hash is kept whole.

    Raises:
        ValueError: neither a non-negative integer below 2**64 nor bytes.
    """
    if isinstance(h, bytes):
        return h
    if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64:
        return h.to_bytes(INT_HASH_BYTES, "big")
    raise ValueError(f"not a vLLM block hash: {h!r:.60}")
