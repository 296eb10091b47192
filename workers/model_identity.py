"""The identity of a model checkpoint: what goes into the cache namespace as ``model_id``.

Two processes may share KV blocks (and token ids) only if they run the same weights, in
the same dtype, under the same config and tokenizer. `checkpoint_fingerprint` hashes all
of that:

* ``config.json`` (architecture, ``torch_dtype``, RoPE, special token ids);
* every tokenizer file the worker reads (``tokenizer.json``, ``generation_config.json``)
  and the usual companions (``tokenizer_config.json``, ``special_tokens_map.json``,
  ``tokenizer.model``); a missing file is hashed as missing, so a folder without
  ``tokenizer.json`` (byte-tokenizer fallback) never matches one with it;
* every byte of every ``*.safetensors`` file, streamed in ``CHUNK_BYTES`` pieces through
  xxh3-128 (never the whole file in memory; ~10 GB/s, so a 16 GB checkpoint costs a
  couple of seconds of a cold page cache's read time).

Whole-file digests are cached in ``$KVMESH_CACHE_DIR`` (default ``~/.cache/kvmesh``)
``/weight-digests.json``, keyed by the file's real path, size and mtime (ns), so a restart
reads no weight file twice for its identity. A cache that cannot be read or written is
ignored (the digest is recomputed).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile

import xxhash

log = logging.getLogger(__name__)

#: Bytes read per step when hashing a weight file.
CHUNK_BYTES = 16 << 20
#: Files besides the weights that decide KV contents or token ids, hashed in this order.
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model")
#: Version of this recipe; a change gives every checkpoint a new id.
IDENTITY_VERSION = 2


def _cache_path() -> str:
    root = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvmesh")
    return os.path.join(root, "weight-digests.json")


def _load_cache() -> dict:
    try:
        with open(_cache_path(), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".digests-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(cache, fh)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("weight digest cache not written (%s)", exc)


def file_digest(path: str, cache: dict | None = None) -> str:
    """xxh3-128 hex digest of a whole file, streamed; ``cache`` (see module doc) is read and
    updated in place when given.

    Raises:
        OSError: the file cannot be read.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{st.st_size}:{st.st_mtime_ns}"
    if cache is not None:
        hit = cache.get(real)
        if isinstance(hit, dict) and hit.get("key") == key and isinstance(hit.get("digest"), str):
            return hit["digest"]
    h = xxhash.xxh3_128()
    with open(real, "rb") as fh:
        while True:
            chunk = fh.read(CHUNK_BYTES)
            if not chunk:
                break
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[real] = {"key": key, "digest": digest}
    return digest


def checkpoint_fingerprint(model_dir: str) -> str:
    """Content hash of a checkpoint directory: 12 hex chars of SHA-256 over the identity
    files and the whole-file digest of every ``*.safetensors`` file (module docstring).

    Raises:
        OSError: config.json or a weight file cannot be read.
    """
    h = hashlib.sha256(f"kvmesh-model-identity-v{IDENTITY_VERSION}".encode())
    for name in IDENTITY_FILES:
        path = os.path.join(model_dir, name)
        h.update(name.encode() + b"\0")
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                data = fh.read()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        elif name == "config.json":
            raise OSError(f"{path}: config.json not found")
        else:
            h.update(b"<missing>")
    cache = _load_cache()
    before = dict(cache)
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        h.update(os.path.basename(path).encode() + b"\0")
        h.update(os.path.getsize(path).to_bytes(8, "little"))
        h.update(file_digest(path, cache).encode())
    if cache != before:
        _save_cache(cache)
    return h.hexdigest()[:12]
