"""Remote tier: KV block records shared by every worker of a cluster, kept in Redis.

A worker that starts (or restarts) with an empty device pool can warm from
what the rest of the cluster stored here. Records are the byte format of
:mod:`cache_store.block_record`; this module only stores, counts and evicts
them.

Redis keys (``C`` is the cluster name, ``H`` a block hash in lowercase hex; a worker's
engine passes ``CLUSTER.TAG``, its KV producer's tag, so that workers whose kernels
differ keep apart: ``cache_store.tier_config.TierConfig.producer``)::

    kvmesh:C:kv:H      string  the encoded record (block_record.encode_record format)
    kvmesh:C:kv-lru    zset    member H, score = access stamp (higher = used more recently),
                               for the blocks of tenant "" (open mode, or no tenant given)
    kvmesh:C:kv-lru:T  zset    the same for the blocks of tenant T
    kvmesh:C:kv-owner  hash    field H -> its tenant (absent: "")
    kvmesh:C:kv-tbytes hash    field T -> record bytes of tenant T's blocks
    kvmesh:C:kv-bytes  string  integer, total record bytes of the blocks in the tier
    kvmesh:C:kv-len    hash    field H -> record bytes counted for H in kv-bytes
    kvmesh:C:kv-clock  string  integer counter that hands out access stamps (INCRBY)
    kvmesh:C:kv-cap    string  the cluster's cap in bytes, set by the first put

Every change to these keys is made by one Lua script (``redis.register_script``),
and Redis runs a script without interleaving other commands, so several
workers writing at once never see or leave a half-made change:

* *put* stores each record that is absent (SET, ZADD, HSET kv-len, INCRBY
  kv-bytes) and only re-stamps one already present; then, while kv-bytes
  exceeds the cap, it pops the lowest stamp (ZPOPMIN) and deletes that block,
  subtracting the bytes counted for it. When the script returns, kv-bytes is
  at most the cap, whoever else is writing.
* *touch* re-stamps the blocks a read returned (``ZADD XX``: a block evicted
  meanwhile is not brought back into the zset).
* *drop* deletes one block and its accounting (a damaged record, or
  :meth:`RemoteTier.clear`).

Invariant kept by the scripts: the members of kv-lru are the fields of
kv-len, and kv-bytes is the sum of kv-len's values. kv-len exists so that
the bytes subtracted for a block are the bytes added for it even when the
stored value was changed or lost behind the tier's back (a damaged or
truncated value, a key removed by Redis's own ``maxmemory`` eviction); with
STRLEN the counter would drift in those cases. A key lost that way is a
miss on read; its kv-len entry is settled when it is evicted or stored again.

Eviction is fair between tenants, as in the device pool and host tier: it takes the least
recently used block of the tenant holding the most bytes (the batch being put counts as
its tenant's), so one tenant's flood pushes out its own blocks once it holds more than
another. With one tenant it is least recently used across the whole cluster: a stamp is taken
from the shared kv-clock when a block is stored, found present by a put, or
returned by :meth:`RemoteTier.get_run`. Within one call the stamps decrease
along the list given (the first block gets the highest), so of blocks used
together the chain's tail is evicted before its head and what stays cached
is a prefix. The cap is per cluster (per ``C``: cluster and KV producer), not per worker: the first put stores its
writer's ``capacity_bytes`` in ``kv-cap`` and every put evicts down to that
value; a worker configured differently logs a warning and follows the
cluster's. An operator changes it with ``SET kvmesh:C:kv-cap <bytes>``.

Authentication (``record_key``): the checksums above catch accidents, not an attacker who
can write to Redis, who could store a record with forged KV and recomputed checksums (block
hashes are unkeyed hashes of public inputs, so one can even be planted before the block is
first computed). With a ``record_key`` every value stored is the record followed by a
``TAG_BYTES``-byte MAC, keyed BLAKE2b (RFC 7693) of the tier's key prefix (cluster and KV
producer) and the record, and a read first checks the
MAC (`hmac.compare_digest`): a record without the cluster key's MAC is treated as damaged
(deleted and counted), so a forged or planted record is never loaded and the next put of the
real block replaces it. Every worker of a cluster needs the same key (`kvmesh worker
--remote-record-key-file`; `kvmesh up` makes one). The engine keeps each key's records apart
(`record_key_id` in the cluster name ``C``, `tier_store._connect_remote`), so workers with
another key or none never read them, and a key rotation or a rolling upgrade starts an
empty tier beside the old one instead of deleting each other's records. A namespace whose
KV producer no live worker names any more (an upgrade) is deleted after a grace period by
:mod:`cache_store.remote_gc`; one left by a key rotation, whose producer is still live, ages
out of Redis only when Redis evicts it or an operator deletes ``kvmesh:C:*``.

What a read verifies: the MAC (with a ``record_key``), then
:func:`cache_store.block_record.decode_record` (magic,
version, header checksum, length, payload checksum) and that the record's
hash is the hash it was stored under. A record failing either is deleted and
counted (``remote_damaged``), and the read stops before it. Whether the
record is the block the *requester* needs (parent, tokens, namespace,
layout) is the caller's check, :meth:`RecordMeta.verify_for`.

Errors and waiting: the class never waits longer than the client lets it.
Build the client with ``socket_timeout`` and ``socket_connect_timeout`` and
a small ``retry`` (redis-py retries a failed command 10 times with backoff
by default), e.g.::

    redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 1))

A Redis error (``redis.exceptions.RedisError``: connection refused, timeout,
OOM, ...) in :meth:`~RemoteTier.get_run`, :meth:`~RemoteTier.put_many` and
:meth:`~RemoteTier.contains` is logged at warning level and counted
(``remote_errors``); the call returns what it has (a miss), it does not
raise. After a connection failure or a timeout the tier stops trying Redis for
``cooldown_s`` (10 s by default; calls are then misses at once, counted as
``remote_skipped``), so a hung Redis costs one timeout per cooldown, not one
per request. A script whose reply was lost to a timeout may still have run to
completion on the server; its effects are then consistent but not reported.

Deployment notes: the block keys are built inside the scripts, so the tier
needs a single Redis instance (not Redis Cluster). Give Redis room for the
cap plus overhead; with ``maxmemory-policy noeviction`` a full Redis refuses
puts (counted as errors), with an ``allkeys-*`` policy it may drop blocks,
which the tier tolerates as misses.

Units: sizes are bytes of encoded records (header + tokens + payload).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from typing import Sequence

import redis

from kvmesh.cache_store.block_record import RecordError, RecordMeta, decode_record, encode_header
from kvmesh.cache_store.tier_config import glob_escape as _glob_escape
from kvmesh.cache_store.tier_config import MIN_RECORD_KEY_BYTES, record_key_from_file  # noqa: F401 (re-exported)

__all__ = [
    "RemoteTier",
    "block_key",
    "lru_key",
    "bytes_key",
    "lengths_key",
    "clock_key",
    "cap_key",
]

log = logging.getLogger(__name__)

#: Record size assumed for sizing the first MGET chunk of a read, before
#: any record was seen (bytes): the upper end of block payloads.
_FIRST_RECORD_GUESS = (2 << 20) + 4096
#: Blocks deleted per script call by :meth:`RemoteTier.clear`.
_CLEAR_BATCH = 512
_HEX_HASH = re.compile(rb"^[0-9a-f]{32}$")
#: Bytes of the MAC that follows each record when the tier has a ``record_key``.
TAG_BYTES = 32
#: BLAKE2b personalization of the record MAC (at most 16 bytes).
_TAG_PERSON = b"kvmesh-kvrecord"


def block_key(block_hash: bytes, cluster: str = "default") -> str:
    """Redis key of one block's record: ``kvmesh:{cluster}:kv:{block_hash.hex()}``."""
    return f"kvmesh:{cluster}:kv:{block_hash.hex()}"


def lru_key(cluster: str = "default") -> str:
    """Sorted set of the tier's blocks by access stamp: ``kvmesh:{cluster}:kv-lru``."""
    return f"kvmesh:{cluster}:kv-lru"


def bytes_key(cluster: str = "default") -> str:
    """Integer total of the tier's record bytes: ``kvmesh:{cluster}:kv-bytes``."""
    return f"kvmesh:{cluster}:kv-bytes"


def owners_key(cluster: str = "default") -> str:
    """Hash of each block's tenant (absent: ""): ``kvmesh:{cluster}:kv-owner``."""
    return f"kvmesh:{cluster}:kv-owner"


def tenant_bytes_key(cluster: str = "default") -> str:
    """Hash of the record bytes held per tenant: ``kvmesh:{cluster}:kv-tbytes``."""
    return f"kvmesh:{cluster}:kv-tbytes"


def lengths_key(cluster: str = "default") -> str:
    """Hash of the bytes counted per block: ``kvmesh:{cluster}:kv-len``."""
    return f"kvmesh:{cluster}:kv-len"


def clock_key(cluster: str = "default") -> str:
    """Counter handing out access stamps: ``kvmesh:{cluster}:kv-clock``."""
    return f"kvmesh:{cluster}:kv-clock"


def cap_key(cluster: str = "default") -> str:
    """The cluster's byte cap, set by the first put: ``kvmesh:{cluster}:kv-cap``."""
    return f"kvmesh:{cluster}:kv-cap"


# Every script: KEYS = lru, bytes, lengths, clock, cap, owners, tenant bytes;
# ARGV[1] = block key prefix.
_PRELUDE = """
local lru, used_key, lens, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owners, tbytes = KEYS[6], KEYS[7]
local prefix = ARGV[1]

-- The LRU of tenant t ('' = the tier's first, tenant-less one).
local function zkey(t)
  if t == '' then return lru end
  return lru .. ':' .. t
end

local function owner_of(hex)
  local t = redis.call('HGET', owners, hex)
  if t then return t end
  return ''
end

-- Bytes stored before tenants were counted are tenant ''s.
if redis.call('EXISTS', tbytes) == 0 then
  local used = tonumber(redis.call('GET', used_key) or '0')
  if used > 0 then redis.call('HSET', tbytes, '', used) end
end

local function add_bytes(t, n)
  if redis.call('HINCRBY', tbytes, t, n) <= 0 then redis.call('HDEL', tbytes, t) end
end

-- Delete one block and its accounting; returns 1 if its key existed.
local function forget(hex)
  local t = owner_of(hex)
  local len = tonumber(redis.call('HGET', lens, hex))
  if len then
    redis.call('HDEL', lens, hex)
    if redis.call('DECRBY', used_key, len) < 0 then redis.call('SET', used_key, 0) end
    add_bytes(t, -len)
  end
  redis.call('HDEL', owners, hex)
  redis.call('ZREM', zkey(t), hex)
  return redis.call('DEL', prefix .. hex)
end
"""

# ARGV[2] = this writer's cap (bytes; it becomes the cluster's if none is set yet),
# ARGV[3] = n, ARGV[4..3+n] = hex hashes, ARGV[4+n..3+2n] = records ('' = only touch
# the block if present), ARGV[4+2n..3+3n] = their tenants.
# Returns {stored count, {evicted hex, ...}, cluster cap}.
_PUT = _PRELUDE + """
local cap = tonumber(redis.call('GET', KEYS[5]))
if not cap then
  cap = tonumber(ARGV[2])
  redis.call('SET', KEYS[5], cap)
end
local n = tonumber(ARGV[3])
local top = redis.call('INCRBY', clock, n)
local stored = 0
for i = 1, n do
  local hex = ARGV[3 + i]
  local rec = ARGV[3 + n + i]
  local tenant = ARGV[3 + 2 * n + i]
  local key = prefix .. hex
  local stamp = top - i + 1
  if redis.call('EXISTS', key) == 1 then
    if redis.call('HEXISTS', lens, hex) == 0 then
      -- written outside the tier: start counting it, as this writer's tenant's
      local len = redis.call('STRLEN', key)
      redis.call('HSET', lens, hex, len)
      redis.call('INCRBY', used_key, len)
      if tenant ~= '' then redis.call('HSET', owners, hex, tenant) end
      add_bytes(tenant, len)
    end
    redis.call('ZADD', zkey(owner_of(hex)), stamp, hex)
  elseif #rec > 0 and #rec <= cap then
    local old = tonumber(redis.call('HGET', lens, hex))
    if old then
      -- the value was lost behind the tier's back: stop counting it
      local was = owner_of(hex)
      redis.call('DECRBY', used_key, old)
      add_bytes(was, -old)
      redis.call('ZREM', zkey(was), hex)
      redis.call('HDEL', owners, hex)
    end
    redis.call('SET', key, rec)
    redis.call('HSET', lens, hex, #rec)
    redis.call('INCRBY', used_key, #rec)
    if tenant ~= '' then redis.call('HSET', owners, hex, tenant) end
    add_bytes(tenant, #rec)
    redis.call('ZADD', zkey(tenant), stamp, hex)
    stored = stored + 1
  end
end
local evicted = {}
while tonumber(redis.call('GET', used_key) or '0') > cap do
  -- the tenant holding the most bytes (with a block left to evict) loses its LRU block
  local victim, most = nil, -1
  local all = redis.call('HGETALL', tbytes)
  for j = 1, #all, 2 do
    local b = tonumber(all[j + 1])
    if b > most and redis.call('ZCARD', zkey(all[j])) > 0 then victim, most = all[j], b end
  end
  local popped = {}
  if victim then popped = redis.call('ZPOPMIN', zkey(victim)) end
  if #popped == 0 then
    redis.call('SET', used_key, 0)
    break
  end
  forget(popped[1])
  evicted[#evicted + 1] = popped[1]
end
return {stored, evicted, cap}
"""

# ARGV[2..] = hex hashes, most important first. Returns the count given.
_TOUCH = _PRELUDE + """
local n = #ARGV - 1
local top = redis.call('INCRBY', clock, n)
for i = 1, n do
  redis.call('ZADD', zkey(owner_of(ARGV[1 + i])), 'XX', top - i + 1, ARGV[1 + i])
end
return n
"""

# ARGV[2] = hex hash, ARGV[3] = sha1 hex of the damaged value read. Deletes the
# block only if it still holds that value (another worker may have replaced it).
_DROP_DAMAGED = _PRELUDE + """
local v = redis.call('GET', prefix .. ARGV[2])
if not v or redis.sha1hex(v) ~= ARGV[3] then return 0 end
return forget(ARGV[2])
"""

# ARGV[2..] = hex hashes. Returns how many block keys existed.
_FORGET = _PRELUDE + """
local dropped = 0
for i = 2, #ARGV do dropped = dropped + forget(ARGV[i]) end
return dropped
"""


class RemoteTier:
    """The cluster's shared store of block records in Redis, capped at ``capacity_bytes``.

    Thread-safe: any number of threads (and processes, and workers) may use
    one instance or several over the same cluster; redis-py clients pool
    their connections.

    Args:
        client: a synchronous ``redis.Redis`` with ``decode_responses=False``
            (the default). Give it ``socket_timeout``, ``socket_connect_timeout``
            and a small ``retry``; the tier waits as long as the client does
            (see the module docstring).
        capacity_bytes: most record bytes the cluster's remote tier holds
            (bytes), > 0. The first put of a cluster stores it as the
            cluster's cap (``kv-cap``); later writers keep that one and log a
            warning when theirs differs, so one worker with a small setting
            cannot empty the tier of every other.
        cluster: cluster name, the key prefix ``kvmesh:{cluster}:``.
        max_batch_bytes: most record bytes sent in one put script call or
            asked for in one MGET (bytes), > 0; a single larger record still
            goes alone. Bounds Redis's time inside one command and the
            memory of one reply.
        cooldown_s: after a connection failure or a timeout, Redis is not
            tried for this long (seconds; 0 = always try): every call returns
            a miss at once instead of each waiting for its own timeout.

    Raises:
        ValueError: ``capacity_bytes`` or ``max_batch_bytes`` not positive,
            ``cooldown_s`` negative, or the client decodes responses.
    """

    medium = "remote"

    def __init__(self, client: redis.Redis, capacity_bytes: int, cluster: str = "default", *,
                 max_batch_bytes: int = 32 << 20, cooldown_s: float = 10.0, record_key: bytes | None = None):
        if record_key is not None and len(record_key) < MIN_RECORD_KEY_BYTES:
            raise ValueError(f"record_key must be at least {MIN_RECORD_KEY_BYTES} bytes, got {len(record_key)}")
        self._record_key = bytes(record_key)[:64] if record_key is not None else None  # BLAKE2b takes <= 64
        self._tag_bytes = TAG_BYTES if record_key is not None else 0
        if capacity_bytes <= 0:
            raise ValueError(f"remote tier capacity must be > 0 bytes (pass the cluster-wide byte cap, "
                             f"e.g. 8 << 30 for 8 GiB), got {capacity_bytes}")
        if max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be > 0 bytes, got {max_batch_bytes}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0 seconds, got {cooldown_s}")
        kwargs = client.get_connection_kwargs()
        if kwargs.get("decode_responses"):
            raise ValueError("the remote tier needs a redis client with decode_responses=False "
                             "(records are binary)")
        if kwargs.get("socket_timeout") is None:
            log.warning("remote tier: the redis client has no socket_timeout; a stalled Redis "
                        "blocks callers until the connection breaks")
        self.client = client
        self.capacity_bytes = int(capacity_bytes)  # the cluster's, once a put has read it
        self.configured_bytes = int(capacity_bytes)
        self.cooldown_s = float(cooldown_s)
        self._down_until = 0.0  # monotonic time before which Redis is not tried
        self.cluster = cluster
        self.max_batch_bytes = int(max_batch_bytes)
        self._prefix = f"kvmesh:{cluster}:kv:"
        self._keys = [lru_key(cluster), bytes_key(cluster), lengths_key(cluster), clock_key(cluster),
                      cap_key(cluster), owners_key(cluster), tenant_bytes_key(cluster)]
        self._put = client.register_script(_PUT)
        self._touch = client.register_script(_TOUCH)
        self._drop_damaged = client.register_script(_DROP_DAMAGED)
        self._forget = client.register_script(_FORGET)
        self._record_guess = _FIRST_RECORD_GUESS  # largest record of the last read (bytes)
        self._lock = threading.Lock()
        from kvmesh.workers.grpc_guard import LogLimiter  # one line per damaged record, bounded

        self._damage_log = LogLimiter(log, "damaged records")
        self._counters = {"remote_stored": 0, "remote_present": 0, "remote_evicted": 0, "remote_refused": 0,
                          "remote_hits": 0, "remote_damaged": 0, "remote_errors": 0, "remote_skipped": 0,
                          "remote_gc_deleted": 0}

    # -- writing -----------------------------------------------------------------
    def put_many(self, records: list[tuple[RecordMeta, bytes | memoryview]],
                 tenants: Sequence[str | None] | None = None) -> tuple[int, list[bytes]]:
        """Store the records not already in the tier; re-stamp those that are.

        One round trip checks which blocks are present, then the absent ones
        are sent in put-script calls of at most ``max_batch_bytes`` of
        records (last chunk first, so stamps decrease along ``records``:
        the first record is the most recently used). A block found present
        is not sent again; if it is evicted between the check and the put
        it stays absent.

        Args:
            records: ``(meta, payload)`` per block; the payload is bytes-like
                of ``meta.payload_len`` bytes whose xxh3_64 is
                ``meta.payload_checksum`` (a wrong checksum is stored, then
                dropped as damaged when read).
            tenants: the tenant of each record (None or "": none), for fair eviction
                between tenants; None: all tenant-less.

        Returns:
            ``(stored, evicted)``: blocks newly stored by this call, and the
            hashes this call evicted to keep the cluster's tier within
            ``capacity_bytes`` (may include blocks it just stored, when the
            records alone exceed the cap). A record larger than
            ``capacity_bytes`` is refused: not stored, not counted in
            ``stored`` (counted as ``remote_refused``). On a Redis error the
            result covers the script calls that completed before it
            (``(0, [])`` when none did); the error is logged and counted.

        Raises:
            ValueError: a payload's length differs from ``meta.payload_len``,
                or the metadata cannot be encoded (before anything is sent).
        """
        todo: list[tuple[RecordMeta, bytes, memoryview]] = []
        owner_of: dict[bytes, str] = {}
        refused = 0
        for k, (meta, payload) in enumerate(records):
            if tenants is not None and tenants[k]:
                owner_of[meta.block_hash] = str(tenants[k])
            mv = memoryview(payload).cast("B")
            if len(mv) != meta.payload_len:
                raise ValueError(f"payload has {len(mv)} bytes, header says {meta.payload_len}")
            head = encode_header(meta)  # ValueError on a malformed meta, before any I/O
            if meta.record_len + self._tag_bytes > self.capacity_bytes:
                refused += 1
            else:
                todo.append((meta, head, mv))
        if refused:
            self._count(remote_refused=refused)
        if not todo or not self._available():
            return 0, []
        try:
            present = self._exists([meta.block_hash for meta, _, _ in todo])
        except redis.RedisError as exc:
            self._error("put", exc)
            return 0, []
        # (hash, header + payload to store, or None to only re-stamp a block found present)
        chunks: list[list[tuple[bytes, tuple[bytes, memoryview] | None]]] = []
        chunk: list[tuple[bytes, tuple[bytes, memoryview] | None]] = []
        chunk_bytes = 0
        for (meta, head, mv), here in zip(todo, present):
            size = 0 if here else meta.record_len + self._tag_bytes
            if chunk and chunk_bytes + size > self.max_batch_bytes:
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
            chunk.append((meta.block_hash, None if here else (head, mv)))
            chunk_bytes += size
        chunks.append(chunk)
        stored, evicted = 0, []
        try:
            for chunk in reversed(chunks):
                n, out = self._put_chunk(chunk, owner_of)
                stored += n
                evicted.extend(out)
        except redis.RedisError as exc:
            self._error("put", exc)
        self._count(remote_stored=stored, remote_present=sum(present), remote_evicted=len(evicted))
        return stored, evicted

    def _put_chunk(self, chunk: list[tuple[bytes, tuple[bytes, memoryview] | None]],
                   owner_of: dict[bytes, str]) -> tuple[int, list[bytes]]:
        hexes = [h.hex() for h, _ in chunk]
        # one copy of each payload, into the record sent (redis-py writes large values as they are)
        values = [b"" if parts is None else self._sealed(b"".join(parts)) for _, parts in chunk]
        owners = [owner_of.get(h, "") for h, _ in chunk]
        stored, evicted, cap = self._put(keys=self._keys, args=[self._prefix, self.configured_bytes, len(chunk),
                                                                 *hexes, *values, *owners])
        self._adopt_cap(int(cap))
        return int(stored), [bytes.fromhex(h.decode("ascii")) for h in evicted]

    def _tag(self, record) -> bytes:
        # the namespace (cluster, KV producer, key id) is under the MAC too: a record copied
        # to another producer's keys by someone who can write to Redis does not verify there
        mac = hashlib.blake2b(self._prefix.encode(), digest_size=TAG_BYTES, key=self._record_key,
                              person=_TAG_PERSON)
        mac.update(record)
        return mac.digest()

    def _sealed(self, record: bytes) -> bytes:
        """The value stored for ``record``: itself, then its MAC when the tier has a key."""
        return record if self._record_key is None else record + self._tag(record)

    def _opened(self, value: bytes) -> memoryview:
        """The record inside a stored value, its MAC checked when the tier has a key.

        Raises:
            RecordError: the value carries no MAC of this tier's key.
        """
        mv = memoryview(value)
        if self._record_key is None:
            return mv
        body, tag = mv[:-TAG_BYTES], mv[-TAG_BYTES:]
        if len(mv) < TAG_BYTES or not hmac.compare_digest(self._tag(body), tag):
            raise RecordError("the record does not carry this cluster's record MAC: written by a worker with "
                              "another --remote-record-key-file (or none), or altered in Redis")
        return body

    def _adopt_cap(self, cap: int) -> None:
        if cap != self.capacity_bytes:
            if cap != self.configured_bytes:
                log.warning("remote tier (%s): the cluster's cap is %d bytes (set by its first writer; SET %s to "
                            "change it); this worker's %d bytes do not apply", self.cluster, cap,
                            cap_key(self.cluster), self.configured_bytes)
            self.capacity_bytes = cap

    # -- reading -----------------------------------------------------------------
    def get_run(self, hashes: Sequence[bytes]) -> list[tuple[RecordMeta, memoryview]]:
        """Records of ``hashes[0], hashes[1], ...`` up to the first one absent or damaged.

        Reads with MGET in chunks of about ``max_batch_bytes`` of records
        (sized from the largest record of the previous chunk), then
        re-stamps the blocks returned in one script call, ``hashes[0]`` the
        most recent. A damaged record (``decode_record`` raises
        :class:`RecordError`, or its hash is not the one asked for) is
        deleted, with its accounting, unless another worker replaced it
        meanwhile, and counted as ``remote_damaged``.

        Only each record's own integrity is checked; the caller checks it
        against its chain with :meth:`RecordMeta.verify_for`.

        Returns:
            ``(meta, payload)`` per block of the run, the payload a view into
            the bytes Redis returned. On a Redis error: what was read before
            it (possibly ``[]``); the error is logged and counted, not raised.
        """
        out: list[tuple[RecordMeta, memoryview]] = []
        if not hashes or not self._available():
            return out
        try:
            self._read_run([bytes(h) for h in hashes], out)
        except redis.RedisError as exc:
            self._error("get_run", exc)
        if out:
            try:
                self._touch(keys=self._keys, args=[self._prefix, *(m.block_hash.hex() for m, _ in out)])
            except redis.RedisError as exc:
                self._error("touch", exc)
            self._count(remote_hits=len(out))
        return out

    def _read_run(self, hashes: list[bytes], out: list) -> None:
        i = 0
        while i < len(hashes):
            n = max(1, self.max_batch_bytes // self._record_guess)
            chunk = hashes[i:i + n]
            values = self.client.mget([self._prefix + h.hex() for h in chunk])
            sizes = [len(v) for v in values if v is not None]
            if sizes:
                self._record_guess = max(1, max(sizes))
            for h, value in zip(chunk, values):
                if value is None:
                    return
                try:
                    meta, payload = decode_record(self._opened(value))
                    if meta.block_hash != h:
                        raise RecordError(f"record of block {meta.block_hash.hex()} stored under {h.hex()}")
                except RecordError as exc:
                    self._count(remote_damaged=1)
                    self._damage_log.warn("remote tier: dropping damaged record %s: %s", h.hex(), exc)
                    self._drop_damaged(keys=self._keys,
                                       args=[self._prefix, h.hex(), hashlib.sha1(value).hexdigest()])
                    return
                out.append((meta, payload))
            i += n

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is in the tier now (one round trip; no LRU change).

        Returns:
            one bool per hash; all False on a Redis error (logged and counted).
        """
        if not self._available():
            return [False] * len(hashes)
        try:
            return [bool(x) for x in self._exists(hashes)]
        except redis.RedisError as exc:
            self._error("contains", exc)
            return [False] * len(hashes)

    def _exists(self, hashes: Sequence[bytes]) -> list[int]:
        if not hashes:
            return []
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self._prefix + h.hex())
        return pipe.execute()

    def forget(self, hashes: Sequence[bytes]) -> int:
        """Delete blocks (with their accounting) that a reader found unusable, e.g. a
        record whose payload size does not fit the model. Returns block keys deleted;
        0 on a Redis error (logged and counted)."""
        if not hashes or not self._available():
            return 0
        try:
            return int(self._forget(keys=self._keys, args=[self._prefix, *(bytes(h).hex() for h in hashes)]))
        except redis.RedisError as exc:
            self._error("forget", exc)
            return 0

    # -- management ----------------------------------------------------------------
    def stats(self) -> dict:
        """Tier size and this instance's counters.

        Returns:
            ``remote_blocks`` and ``remote_bytes`` (the cluster's tier now,
            blocks and bytes; None if Redis could not be read),
            ``remote_capacity_bytes`` (the cluster's cap as last seen, else this
            instance's, bytes), and counts
            of blocks since this instance was made: ``remote_stored``,
            ``remote_present`` (found already stored by a put),
            ``remote_evicted`` (by this instance's puts), ``remote_refused``
            (larger than the cap), ``remote_hits`` (returned by get_run),
            ``remote_damaged``; ``remote_errors`` (failed Redis calls),
            ``remote_skipped`` (calls not made while Redis was cooling down) and
            ``remote_gc_deleted`` (keys of abandoned namespaces this worker's
            :class:`cache_store.remote_gc.RemoteGC` deleted; keys, not blocks).
        """
        blocks = used = None
        if self._available():
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.hlen(self._keys[2])  # every tenant's blocks
                pipe.get(self._keys[1])
                b, u = pipe.execute()
                blocks, used = int(b), int(u or 0)
            except redis.RedisError as exc:
                self._error("stats", exc)
        with self._lock:
            counters = dict(self._counters)
        return {"remote_blocks": blocks, "remote_bytes": used, "remote_capacity_bytes": self.capacity_bytes,
                **counters}

    def clear(self) -> int:
        """Delete every block of this cluster's remote tier, for all its workers.

        Deletes the blocks in the LRU in batches, then any ``kv:`` key left
        outside it (written behind the tier's back). Safe while other
        workers write; blocks they store during the call may survive it.

        Returns:
            block keys deleted.

        Raises:
            redis.RedisError: Redis failed (blocks deleted until then stay deleted).
        """
        dropped = 0
        rounds = int(self.client.hlen(self._keys[2])) // _CLEAR_BATCH + 2
        for _ in range(rounds):  # every tenant's counted blocks
            members = [f for f, _ in zip(self.client.hscan_iter(self._keys[2], count=_CLEAR_BATCH),
                                         range(_CLEAR_BATCH))]
            if not members:
                break
            dropped += int(self._forget(keys=self._keys, args=[self._prefix, *(f for f, _ in members)]))
        stray: list[bytes] = []
        plen = len(self._prefix.encode())
        for key in self.client.scan_iter(match=_glob_escape(self._prefix) + "*", count=1000):
            if _HEX_HASH.match(key[plen:]):
                stray.append(key[plen:])
            if len(stray) >= _CLEAR_BATCH:
                dropped += int(self._forget(keys=self._keys, args=[self._prefix, *stray]))
                stray = []
        if stray:
            dropped += int(self._forget(keys=self._keys, args=[self._prefix, *stray]))
        return dropped

    # -- internals ---------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counters[name] += d

    def _available(self) -> bool:
        """False (and counted as ``remote_skipped``) while Redis is cooling down after a
        connection failure or a timeout."""
        if self._down_until and time.monotonic() < self._down_until:
            self._count(remote_skipped=1)
            return False
        return True

    def _error(self, what: str, exc: Exception) -> None:
        self._count(remote_errors=1)
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and self.cooldown_s > 0:
            # unreachable or silent: every caller would wait its timeout again; stop trying for a while
            with self._lock:
                opened = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self.cooldown_s
            if opened:
                log.warning("remote tier (%s): %s failed: %s: %s; not trying Redis for %.0f s", self.cluster,
                            what, type(exc).__name__, exc, self.cooldown_s)
            return
        log.warning("remote tier (%s): %s failed: %s: %s", self.cluster, what, type(exc).__name__, exc)


def record_key_id(record_key: bytes) -> str:
    """8 hex digits naming a record key (keyed BLAKE2b of nothing: the key cannot be
    recovered from it), for the Redis namespace of the records made with it."""
    return hashlib.blake2b(b"", key=bytes(record_key)[:64], digest_size=4, person=b"kvmesh-keyid").hexdigest()
