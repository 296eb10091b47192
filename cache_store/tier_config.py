"""Sizes and codecs of a worker's tiers below the device pool (`TierConfig`).

Kept apart from :mod:`cache_store.tier_store` so that the command line can check tier
flags without importing torch: ``kvmesh up --disk-dir X`` without ``--disk-bytes``
answers in a fraction of a second instead of after torch's import (several seconds on a
small machine).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

__all__ = ["WRITE_MODES", "LOAD_POLICIES", "BUILTIN_CODECS", "TierConfig"]

#: Codecs `cache_store.kv_codec` registers on import; a name among these is valid
#: without importing the registry (which imports torch).
BUILTIN_CODECS = ("none", "fp8", "int4")


def _codec_names(name: str):
    """Names ``name`` is checked against: the built-in ones, or the whole registry when
    ``name`` is not built in (a codec registered with ``kv_codec.register_codec``)."""
    if name in BUILTIN_CODECS:
        return BUILTIN_CODECS
    from kvmesh.cache_store.kv_codec import CODECS

    return tuple(CODECS)


#: How blocks reach the disk tier.
WRITE_MODES = ("through", "back")

#: When a block found in a lower tier is loaded rather than recomputed.
LOAD_POLICIES = ("auto", "cost", "always")


#: Default size of the staging area (bytes): `TierConfig.peer_bytes`, ``--peer-bytes``.
DEFAULT_PEER_BYTES = 64 << 20

#: Shortest accepted ``record_key`` (bytes).
MIN_RECORD_KEY_BYTES = 16


def staging_must_fit(peer_bytes: int, remote_bytes: int) -> bool:
    """Whether a staging area of ``peer_bytes`` must hold at least one block: a size the user
    chose, or any size with a remote tier (which reads only through it). The default size,
    too small for a large model's blocks, only turns staging off (with a warning)."""
    return peer_bytes > 0 and (peer_bytes != DEFAULT_PEER_BYTES or remote_bytes > 0)


def record_key_from_file(path: str) -> bytes:
    """The remote tier's record key from a key file: SHA-256 of the file's content with
    surrounding whitespace stripped (`kvmesh up` writes 64 random hex digits).

    Raises:
        ValueError: the file cannot be read, or holds fewer than 32 characters.
    """
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 16).strip()
    except OSError as exc:
        raise ValueError(f"cannot read the record key file {path!r}: {exc.strerror or exc}") from None
    if len(text) < 32:
        raise ValueError(f"record key file {path!r} holds {len(text)} characters; give at least 32 random ones "
                         "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > FILE`)")
    return hashlib.sha256(text).digest()


@dataclass(frozen=True)
class TierConfig:
    """Sizes and codecs of the tiers below the device pool.

    Attributes:
        host_bytes: host tier capacity (bytes); 0 disables it (and with it
            offloading, since every lower tier is fed through host memory).
        host_codec: codec of the host tier (``kv_codec.CODECS``).
        disk_dir: directory of the disk tier; None disables it.
        disk_bytes: disk tier capacity (bytes); required with ``disk_dir``.
        disk_codec: codec of the disk tier.
        write_mode: ``"through"`` (default) or ``"back"``; see the module doc.
        segment_bytes: largest disk segment file (bytes).
        peer_bytes: staging area for blocks fetched from peers or read from
            the remote tier before their request is scheduled (bytes); 0
            disables peer fetches and reads from the remote tier.
        max_pending_write_bytes: most host bytes queued for disk (bytes), and
            separately most queued for the remote tier.
        fsync: fsync disk segments (leave on outside tests).
        remote_url: Redis URL of the shared remote tier (``redis://host:port/db``);
            used when ``remote_bytes > 0``.
        remote_bytes: the cluster-wide cap of the remote tier (bytes of
            records, see :mod:`cache_store.remote_tier`); 0 disables it.
        remote_codec: codec of the records this worker puts in the remote tier.
        remote_cluster: cluster name, the Redis key namespace.
        remote_record_key: secret key (16-64 bytes) of the MAC each remote record carries
            (`cache_store.remote_tier`, "Authentication"), the same on every worker of the
            cluster; None: records are stored and read unauthenticated (anyone who can write
            to the cluster's Redis can change the KV a worker loads). Not shown in repr.
        producer: tag of what computes the KV (`workers.model_identity.producer_tag`;
            the engine sets it): remote records live under ``kvmesh:{cluster}.{tag}:``, and
            a disk folder whose segments another producer wrote is emptied at start, so
            workers on other hardware or kernels never load each other's blocks. "" for none.
        remote_timeout_s: socket timeout of each Redis call of the remote tier
            (seconds); a slower Redis counts as a miss, never a long wait.
        load_policy: ``"cost"``: a request stops loading from a lower tier at the first
            block whose tier has measured slower per block than the worker's prefill
            computes one (`TierStore.load_seconds_per_block` against the engine's
            prefill rate), and computes the rest; ``"always"``: load every block found;
            ``"auto"`` (default): ``"cost"`` for a pool on a GPU, where a small model's
            prefill can beat a disk read, ``"always"`` on the CPU, where every tier
            measured several times faster than prefill (docs/TIERS.md).
    """

    host_bytes: int = 0
    host_codec: str = "none"
    disk_dir: str | None = None
    disk_bytes: int = 0
    disk_codec: str = "none"
    write_mode: str = "through"
    segment_bytes: int = 16 << 20
    peer_bytes: int = DEFAULT_PEER_BYTES
    max_pending_write_bytes: int = 256 << 20
    fsync: bool = True
    remote_url: str | None = None
    remote_bytes: int = 0
    remote_codec: str = "none"
    remote_cluster: str = "default"
    remote_record_key: bytes | None = field(default=None, repr=False)
    producer: str = ""
    remote_timeout_s: float = 1.0
    load_policy: str = "auto"

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("host_bytes", "disk_bytes", "peer_bytes", "segment_bytes", "max_pending_write_bytes",
                     "remote_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (bytes), got {v!r}")
        for name in ("host_codec", "disk_codec", "remote_codec"):
            known = _codec_names(getattr(self, name))
            if getattr(self, name) not in known:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(sorted(known))}")
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {LOAD_POLICIES}, got {self.load_policy!r}")
        if self.write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")
        if self.disk_dir:
            if self.disk_bytes <= 0:
                raise ValueError("a disk tier (disk_dir) needs disk_bytes > 0")
            if self.host_bytes <= 0:
                raise ValueError("a disk tier needs a host tier (host_bytes > 0): blocks reach disk through it")
        elif self.disk_bytes:
            raise ValueError("disk_bytes without disk_dir sets up no disk tier: add disk_dir (the tier's directory) "
                             "or drop disk_bytes")
        if self.remote_bytes:
            if not self.remote_url:
                raise ValueError("a remote tier (remote_bytes > 0) needs remote_url, the cluster's Redis")
            if self.host_bytes <= 0:
                raise ValueError("a remote tier needs a host tier (host_bytes > 0): blocks reach it through it")
            if self.peer_bytes <= 0:
                raise ValueError("a remote tier needs a staging area (peer_bytes > 0): blocks read from it wait "
                                 "there for their request")
            if not self.remote_timeout_s > 0:
                raise ValueError(f"remote_timeout_s must be > 0 seconds, got {self.remote_timeout_s!r}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.peer_bytes > 0 or self.remote_bytes > 0


def glob_escape(s: str) -> str:
    """``s`` with Redis glob metacharacters (``* ? [ ] \\``) escaped, for ``SCAN ... MATCH``."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)
