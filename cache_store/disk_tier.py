"""Disk tier: KV block records in segment files under one directory, with a byte cap.

Blocks reach disk in batches; each batch becomes one *segment* file holding
the records (:mod:`cache_store.block_record`) back to back. One file per
block would pay a file creation and an fsync per block, which for small
blocks costs more than the data (on ext4 a 64 KiB block file takes longer to
create and sync than to write); a segment costs one of each per batch.

Segment file format (``SEGMENT_FORMAT_VERSION`` 1, little-endian)::

    magic        4s   b"KVS1"
    version      u16  SEGMENT_FORMAT_VERSION
    reserved     u16  0
    num_records  u32
    total_len    u64  size of the whole file (bytes)
    checksum     u64  xxh3_64 of the 20 bytes above
    records      num_records records (block_record format)

Crash safety: a segment is written to ``seg-<id>.<pid>.tmp``, fsynced,
renamed to ``seg-<id>.kvs`` and the directory fsynced (once per batch of
segments written together); only then do its blocks enter the index. A process killed mid-write leaves a ``.tmp`` file,
which is never read and is deleted at the next start (only names of exactly
that form, and only regular files: other ``.tmp`` files are not the tier's).
At start the tier re-indexes every ``.kvs`` file: the segment header, the
file size, and each record's header checksum are checked (payloads are
checked when read, so a start does not read the whole tier); a file failing
any check is *damaged* and deleted. A payload that fails its checksum when
read drops its whole segment.

Sound segments this worker cannot load are *foreign*: records of another
layout (dtype or block shape: another ``--block-size`` or model), when the
tier is given the codecs its worker loads only of other codecs, or written
by another KV producer (`DiskTier.adopt_producer`). They
are left in place, neither indexed nor deleted, so one start with the wrong
settings does not wipe the tier; their bytes count toward
``capacity_bytes`` and they are the first deleted when room is needed,
oldest first.

Start-up never follows a link: entries named like segments or ``.tmp``
files that are not regular files (symlinks, directories, FIFOs, ...) are
skipped with a warning and left alone, files are opened with
``O_NOFOLLOW``, and permissions are tightened through the open descriptor.

Segment files owned by another user are never loaded: block hashes are public
functions of the prompt, so whoever can write the folder could plant records
with valid checksums for a prompt another tenant will send. At start they are
skipped with the warning above; a file replaced under an indexed segment's name
fails the owner check on read and the segment is dropped. A folder every user
may write is refused unless it has the sticky bit (/tmp's ``1777``), under
which others cannot delete or rename this worker's files.

Eviction is by segment, least recently used first (a hit on any block
touches its segment), so the bytes on disk never exceed ``capacity_bytes``
once a write completes. Blocks written together are usually read together
(the blocks of one sequence leave the device pool together), which is what
makes a segment a reasonable eviction unit.

Not thread-safe by itself: the index methods run under
:class:`cache_store.tier_store.TierStore`'s lock; :meth:`DiskTier.write_segment`
does file I/O only and runs on the store's writer thread without it.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

import xxhash

from kvmesh.cache_store.block_record import HEADER_BYTES, RecordError, RecordMeta, encode_header, parse_header, verify_payload

__all__ = ["SEGMENT_FORMAT_VERSION", "DiskEntry", "Segment", "DiskTier", "SegmentReadError"]

log = logging.getLogger(__name__)

SEGMENT_FORMAT_VERSION = 1
_SEG_MAGIC = b"KVS1"
_SEG_HEAD = struct.Struct("<4sHHIQ")
_SEG_SUM = struct.Struct("<Q")
SEGMENT_HEADER_BYTES = _SEG_HEAD.size + _SEG_SUM.size
_SEG_NAME = re.compile(r"seg-([0-9a-f]{16})\.kvs")  # used with fullmatch
_TMP_NAME = re.compile(r"seg-[0-9a-f]{16}\.[0-9]+\.tmp")  # `write_segment`'s unfinished files
#: flags of every open of a file already in the directory: never through a symlink, and never
#: waiting on a FIFO planted under a segment's name (no effect on a regular file)
_OPEN_EXISTING = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class SegmentReadError(RecordError):
    """A record could not be read: ``index`` is its position in the batch read; ``damaged``
    is True when the file failed a check (False when the block merely left the tier)."""

    def __init__(self, message: str, index: int, segment: int, damaged: bool = True):
        super().__init__(message)
        self.index = index
        self.segment = segment
        self.damaged = damaged


@dataclass(slots=True, eq=False)
class DiskEntry:
    """Where one block's record lives: segment id and byte offset of the record."""

    meta: RecordMeta
    segment: int
    offset: int


@dataclass(slots=True, eq=False)
class Segment:
    """One segment file and the blocks of it still indexed."""

    seg_id: int
    path: str
    size: int
    hashes: set = field(default_factory=set)
    owner: object = None  # the tenant whose blocks it holds (None: none, or not known after a restart)


class DiskTier:
    """Index over the segment files of one directory, capped at ``capacity_bytes``.

    Args:
        directory: where segments live (created if missing).
        capacity_bytes: most bytes of segment files kept (bytes), > 0.
        block_shape: the pool's ``(layers, 2, kv_heads, block_size, head_dim)``.
        dtype: the pool's dtype name ("float32", ...).
        segment_bytes: largest segment written (bytes); at least one record
            always fits, and it is capped at ``capacity_bytes``.
        fsync: fsync segments and the directory (turn off only in tests of
            unrelated behaviour).
        codecs: names of the codecs whose records the worker loads; a segment
            whose records are all of other codecs is foreign (see the module
            doc), and records of other codecs are not indexed. None: every
            codec is indexed.

    Raises:
        ValueError: capacity not positive, or another live process (or another `DiskTier`
            here) holds the directory: two writers would pick the same segment ids and
            delete each other's files; or every user may write the directory and it lacks
            the sticky bit (`others_may_write`: others could delete or rename this
            worker's files).
            Segment files owned by another user are never indexed nor read (skipped at
            start with a warning, dropped if one replaces an indexed file).
        OSError: the directory cannot be created.
    """

    medium = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_shape: tuple[int, ...], dtype: str,
                 segment_bytes: int = 16 << 20, fsync: bool = True, codecs: Collection[str] | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be > 0 bytes, got {capacity_bytes}")
        self.directory = os.path.abspath(directory)
        # segments hold tenants' token ids and KV: a folder made here is this user's only, and
        # segment files are 0600 wherever they are (a folder given, e.g. a shared mount, is
        # left as it is)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if others_may_write(os.stat(self.directory).st_mode):
            raise ValueError(f"disk tier folder {self.directory} may be written by every user of this machine "
                             f"(o+w, no sticky bit): they could delete or replace its segments; run "
                             f"`chmod o-w {self.directory}` or name a folder of this user's own")
        self._lock_file = _lock_directory(self.directory)
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = int(min(segment_bytes, capacity_bytes))
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.fsync = fsync
        self.codecs = None if codecs is None else frozenset(codecs)
        self.entries: dict[bytes, DiskEntry] = {}
        self.segments: OrderedDict[int, Segment] = OrderedDict()  # least recently used first
        #: sound segments this worker cannot load (module doc), oldest id first: on disk and
        #: counted in ``used_bytes``, never indexed; the first deleted when room is needed
        self.foreign: OrderedDict[int, Segment] = OrderedDict()
        #: bytes of segment files on disk, indexed and foreign (bytes)
        self.used_bytes = 0
        self._next_id = 0
        #: segments deleted because a check failed (at start or on read)
        self.num_damaged = 0
        #: leftover .tmp files removed at start (writes cut short by a crash)
        self.num_torn = 0
        #: foreign segments deleted to make room for this worker's own
        self.num_foreign_evicted = 0
        #: this process's KV producer and the folder's producer changes (`adopt_producer`);
        #: None: segments are not told apart by producer
        self._producer: str | None = None
        self._producer_history: list[tuple[int, str]] = []

    @property
    def foreign_bytes(self) -> int:
        """Bytes of the foreign segments left in place (bytes)."""
        return sum(seg.size for seg in self.foreign.values())

    #: File naming the KV producer whose segments the folder holds (`adopt_producer`).
    PRODUCER_NAME = ".kvmesh-producer"

    #: Most producer changes the producer file remembers (older segments count as foreign).
    PRODUCER_HISTORY = 32

    def adopt_producer(self, tag: str) -> int:
        """Record ``tag`` as the KV producer of the segments this process writes, and leave
        the segments other producers wrote (a volume moved to a node with another GPU, an
        image with another torch, another ``--threads``) in place as foreign: `scan` does not
        index them, they count toward the byte cap and are deleted first when room is needed,
        and a later start with their producer indexes them again. Call before `scan`.

        The producer file holds one line per producer change, ``TAG FIRST_SEGMENT_ID``: a
        segment belongs to the last producer whose first id is at or below its own (a file
        of one bare ``TAG`` line, as earlier versions wrote, covers every segment). At most
        ``PRODUCER_HISTORY`` changes are kept; segments older than the oldest kept count as
        another producer's.

        Returns:
            the segments of other producers found (0 when ``tag`` is "").

        Raises:
            ValueError: the producer file is a symlink or not a regular file (it is
                neither followed nor replaced).
            OSError: the producer file cannot be read or written.
        """
        if not tag:
            return 0
        path = os.path.join(self.directory, self.PRODUCER_NAME)
        try:
            fd = os.open(path, _OPEN_EXISTING)
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise ValueError(f"disk_dir {self.directory}: cannot open {self.PRODUCER_NAME} ({exc.strerror}); "
                             "it must be a regular file, not a link") from None
        else:
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"disk_dir {self.directory}: {self.PRODUCER_NAME} is not a regular file; "
                                     "remove it")
                text = f.read(1 << 16).decode("ascii", errors="replace")
        history: list[tuple[int, str]] = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 1 and not history:
                history.append((0, parts[0]))
            elif len(parts) == 2 and parts[1].isdigit():
                history.append((int(parts[1]), parts[0]))
        ids = [int(m.group(1), 16) for m in map(_SEG_NAME.fullmatch, os.listdir(self.directory)) if m]
        if not history or history[-1][1] != tag:
            history.append((max(ids, default=-1) + 1, tag))
            history = history[-self.PRODUCER_HISTORY:]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            with open(fd, "w", encoding="ascii") as f:
                f.write("".join(f"{t} {first}\n" for first, t in history))
        self._producer, self._producer_history = tag, history
        others = sum(1 for name in os.listdir(self.directory)
                     if (m := _SEG_NAME.fullmatch(name)) and self._producer_of(int(m.group(1), 16)) != tag
                     and _kind(os.path.join(self.directory, name)) == "file")
        if others:
            log.warning("disk tier %s: %d segment(s) written by another KV producer left in place, not indexed "
                        "(their KV differs in low bits from what this worker, %s, computes); a start with their "
                        "producer uses them again, and they are deleted first when room is needed",
                        self.directory, others, tag)
        return others

    def _producer_of(self, seg_id: int) -> str | None:
        """The producer tag that wrote segment ``seg_id`` (`adopt_producer`'s history), or
        None when it is older than the history kept."""
        found = None
        for first, tag in self._producer_history:
            if first <= seg_id:
                found = tag
        return found

    def release(self) -> None:
        """Give the directory up for another process (its lock; the files stay). Idempotent."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- start-up ----------------------------------------------------------------
    def scan(self) -> list[RecordMeta]:
        """Re-index the directory: delete unfinished writes and damaged segments, leave
        foreign ones in place (module doc).

        Segments enter the LRU oldest id first. A block present in two
        segments is indexed from the newer one. Segments over capacity are
        evicted: foreign ones first, then indexed ones, each oldest first.
        Entries that are not regular files are skipped and left alone, with
        one warning.

        Returns:
            metadata of every block indexed, for advertising.
        """
        found: list[tuple[int, str]] = []
        skipped: list[str] = []
        for name in sorted(os.listdir(self.directory)):
            m = _SEG_NAME.fullmatch(name)
            torn = m is None and _TMP_NAME.fullmatch(name) is not None
            if m is None and not torn:
                continue
            if m is not None:  # never reuse the id, whatever the entry is
                self._next_id = max(self._next_id, int(m.group(1), 16) + 1)
            path = os.path.join(self.directory, name)
            kind = _kind(path)
            if kind is None:  # gone since listed
                continue
            if kind != "file":
                skipped.append(f"{name} ({kind})")
            elif torn:
                _unlink(path)
                self.num_torn += 1
            else:
                found.append((int(m.group(1), 16), path))
        foreign: Counter = Counter()
        partly: dict[int, str] = {}  # segments holding records not indexed: why the first is not
        for seg_id, path in sorted(found):
            try:
                metas, offsets, size, why_not = self._read_index(path)
            except _NotOurs as exc:
                skipped.append(f"{os.path.basename(path)} ({exc.args[0]})")
                continue
            except (RecordError, OSError) as exc:
                log.warning("disk tier: deleting damaged segment %s: %s", path, exc)
                _unlink(path)
                self.num_damaged += 1
                continue
            self.used_bytes += size
            if self._producer is not None and self._producer_of(seg_id) != self._producer:
                why_not = ["written by another KV producer"] * max(1, len(why_not))
            if why_not and all(why_not):
                self.foreign[seg_id] = Segment(seg_id, path, size)
                foreign[why_not[0]] += 1
                continue
            seg = Segment(seg_id, path, size)
            for meta, off, why in zip(metas, offsets, why_not):
                if why:
                    partly.setdefault(seg_id, why)
                    continue
                old = self.entries.get(meta.block_hash)
                if old is not None:
                    self.segments[old.segment].hashes.discard(meta.block_hash)
                self.entries[meta.block_hash] = DiskEntry(meta, seg_id, off)
                seg.hashes.add(meta.block_hash)
            self.segments[seg_id] = seg
        for seg in [s for s in self.segments.values() if not s.hashes]:
            if seg.seg_id in partly:  # the rest of its records are foreign: kept as foreign segments are
                del self.segments[seg.seg_id]
                self.foreign[seg.seg_id] = seg
                foreign[partly[seg.seg_id]] += 1
            else:  # empty, or every block is in a newer segment
                self._delete_segment(seg.seg_id)
        self.foreign = OrderedDict(sorted(self.foreign.items()))
        if skipped:
            shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            log.warning("disk tier %s: left %d entr%s named like segment files alone (not regular files, "
                        "unreadable, or of another owner): %s", self.directory, len(skipped),
                        "y" if len(skipped) == 1 else "ies", shown)
        if foreign:
            codecs = "/".join(sorted(self.codecs)) if self.codecs is not None else "any"
            log.warning("disk tier %s: %d segment(s) of another layout, codec or KV producer left in place (%d bytes), not "
                        "indexed: %s (this worker: %s%s, codecs %s); they count toward the byte cap and are "
                        "deleted first when room is needed", self.directory, len(self.foreign),
                        self.foreign_bytes, ", ".join(f"{n} {why}" for why, n in foreign.items()), self.dtype,
                        list(self.block_shape), codecs)
        self.evict_to_capacity()
        return [e.meta for e in self.entries.values()]

    def _why_not(self, meta: RecordMeta) -> str:
        """Why a sound record is not indexed ("" when it is): another layout or codec."""
        if meta.dtype != self.dtype or tuple(meta.shape) != self.block_shape:
            return f"of layout {meta.dtype}{list(meta.shape)}"
        if self.codecs is not None and meta.codec not in self.codecs:
            return f"in codec {meta.codec}"
        return ""

    def _read_index(self, path: str) -> tuple[list[RecordMeta], list[int], int, list[str]]:
        """Check a segment file's structure and read its record headers.

        Opens without following a link or waiting on a FIFO, and makes the file
        private (0600) through the open descriptor when it is this user's, has one
        link and is readable by others (segments written before files were private).

        Returns:
            ``(metas, offsets, size, why_not)``: each record's metadata and byte
            offset, the file size (bytes), and per record why it is not indexed
            (`_why_not`; "" when it is).

        Raises:
            _NotOurs: the file cannot be opened (a symlink or a socket put there since it
                was listed, no permission), or is no longer a regular file.
            RecordError: the file is damaged (bad magic, version, checksum, truncated,
                trailing bytes).
            OSError: the file cannot be read.
        """
        try:
            fd = os.open(path, _OPEN_EXISTING)
        except OSError as exc:
            raise _NotOurs(f"cannot open: {exc.strerror}") from None
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _NotOurs(_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
            if st.st_uid != os.geteuid():
                raise _NotOurs(_foreign_owner(st))
            if st.st_mode & 0o077 and st.st_nlink == 1 and st.st_uid == os.geteuid():
                try:
                    os.fchmod(fd, 0o600)
                except OSError:
                    pass
            size = st.st_size
            head = f.read(SEGMENT_HEADER_BYTES)
            if len(head) < SEGMENT_HEADER_BYTES:
                raise RecordError("truncated segment header")
            magic, version, _, count, total = _SEG_HEAD.unpack_from(head)
            (csum,) = _SEG_SUM.unpack_from(head, _SEG_HEAD.size)
            if magic != _SEG_MAGIC or version != SEGMENT_FORMAT_VERSION:
                raise RecordError("bad segment magic or version")
            if xxhash.xxh3_64_intdigest(head[: _SEG_HEAD.size]) != csum:
                raise RecordError("segment header checksum mismatch")
            if total != size:
                raise RecordError(f"segment is {size} bytes, header says {total} (truncated?)")
            metas, offsets, why_not = [], [], []
            off = SEGMENT_HEADER_BYTES
            for _ in range(count):
                f.seek(off)
                head = f.read(HEADER_BYTES)
                ntok = struct.unpack_from("<H", head, 6)[0] if len(head) >= 8 else 0
                toks = f.read(4 * ntok)
                meta = parse_header(head, toks)
                metas.append(meta)
                offsets.append(off)
                why_not.append(self._why_not(meta))
                off += meta.record_len
                if off > size:
                    raise RecordError("record runs past the end of the segment")
            if off != size:
                raise RecordError("bytes after the last record")
        return metas, offsets, size, why_not

    # -- writing (no index changes; writer thread) ---------------------------------
    def new_segment_id(self) -> int:
        """A fresh segment id (call under the store's lock)."""
        self._next_id += 1
        return self._next_id - 1

    def write_segment(self, seg_id: int, items: list[tuple[RecordMeta, object]], sync_dir: bool = True) -> Segment:
        """Write records as segment ``seg_id``: tmp file, fsync, rename, fsync directory.

        Args:
            seg_id: from :meth:`new_segment_id`.
            items: ``(meta, payload)`` per block; payloads are bytes-like of
                ``meta.payload_len`` bytes matching ``meta.payload_checksum``.
            sync_dir: fsync the directory after the rename. A caller writing
                several segments may pass False and call :meth:`sync_directory`
                once before indexing them (the rename still follows the data
                fsync, so a file under its final name is never torn; the
                directory fsync only makes the name itself durable).

        Returns:
            the segment (not yet indexed; see :meth:`add_segment`). Its
            ``hashes`` holds the blocks written.

        Raises:
            OSError: the write failed (the tmp file is removed).
        """
        headers = [encode_header(meta) for meta, _ in items]
        total = SEGMENT_HEADER_BYTES + sum(len(h) + meta.payload_len for h, (meta, _) in zip(headers, items))
        head = _SEG_HEAD.pack(_SEG_MAGIC, SEGMENT_FORMAT_VERSION, 0, len(items), total)
        head += _SEG_SUM.pack(xxhash.xxh3_64_intdigest(head))
        final = os.path.join(self.directory, f"seg-{seg_id:016x}.kvs")
        tmp = os.path.join(self.directory, f"seg-{seg_id:016x}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            bufs: list = [head]
            for h, (_, payload) in zip(headers, items):
                bufs.append(h)
                bufs.append(memoryview(payload).cast("B"))
            _write_all(fd, bufs)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, final)
        if sync_dir:
            self.sync_directory()
        return Segment(seg_id, final, total, {meta.block_hash for meta, _ in items})

    def sync_directory(self) -> None:
        """fsync the directory, making completed renames durable (no-op without ``fsync``)."""
        if self.fsync:
            _fsync_dir(self.directory)

    # -- index (under the store's lock) -------------------------------------------
    def add_segment(self, seg: Segment, metas: list[RecordMeta], owner: object = None
                    ) -> tuple[list[RecordMeta], list[RecordMeta]]:
        """Index a written segment as most recently used, then evict down to capacity.

        Blocks already indexed elsewhere keep their old record. ``owner``: the tenant
        whose blocks the segment holds (the writer groups blocks by tenant), for fair
        eviction (`evict_to_capacity`).

        Returns:
            ``(added, removed)``: metadata of the blocks newly indexed, and of
            the blocks dropped by eviction.
        """
        added = []
        off = SEGMENT_HEADER_BYTES
        seg.hashes = set()
        for meta in metas:
            if meta.block_hash not in self.entries:
                self.entries[meta.block_hash] = DiskEntry(meta, seg.seg_id, off)
                seg.hashes.add(meta.block_hash)
                added.append(meta)
            off += meta.record_len
        seg.owner = owner
        self.segments[seg.seg_id] = seg
        self.used_bytes += seg.size
        removed = self.evict_to_capacity(keep=seg.seg_id)
        if not seg.hashes and seg.seg_id in self.segments:
            self._delete_segment(seg.seg_id)
        return added, removed

    def evict_to_capacity(self, keep: int | None = None) -> list[RecordMeta]:
        """Delete segments until within capacity; returns dropped blocks' metadata.

        Foreign segments (module doc) go first, oldest first, logged. Then fair between
        tenants, as the other tiers: the least recently used segment of the tenant whose
        segments hold the most bytes (``keep``'s counted too); with one tenant, the least
        recently used segment. O(segments) per segment deleted.
        """
        removed: list[RecordMeta] = []
        if self.used_bytes <= self.capacity_bytes:
            return removed
        freed = count = 0
        while self.foreign and self.used_bytes > self.capacity_bytes:
            _, seg = self.foreign.popitem(last=False)
            self.used_bytes -= seg.size
            _unlink(seg.path)
            freed += seg.size
            count += 1
        if count:
            self.num_foreign_evicted += count
            log.info("disk tier %s: deleted %d segment(s) of another layout or codec (%d bytes) to make room; "
                     "%d left", self.directory, count, freed, len(self.foreign))
        if self.used_bytes <= self.capacity_bytes:
            return removed
        by_owner: dict = {}
        for seg in self.segments.values():
            by_owner[seg.owner] = by_owner.get(seg.owner, 0) + seg.size
        while self.used_bytes > self.capacity_bytes:
            candidates = [s for s in self.segments.values() if s.seg_id != keep]
            if not candidates:
                break
            victim = candidates[0]
            if len(by_owner) > 1:
                heaviest = max({s.owner for s in candidates}, key=by_owner.__getitem__)
                victim = next(s for s in candidates if s.owner == heaviest)
            by_owner[victim.owner] -= victim.size
            removed.extend(self._delete_segment(victim.seg_id))
        return removed

    def drop_segment(self, seg_id: int) -> list[RecordMeta]:
        """Delete a segment (damaged, or on request); returns the metadata of its indexed blocks."""
        return self._delete_segment(seg_id)

    def _delete_segment(self, seg_id: int) -> list[RecordMeta]:
        seg = self.segments.pop(seg_id, None)
        if seg is None:
            return []
        out = []
        for h in seg.hashes:
            e = self.entries.get(h)
            if e is not None and e.segment == seg_id:
                del self.entries[h]
                out.append(e.meta)
        self.used_bytes -= seg.size
        _unlink(seg.path)
        return out

    def touch(self, block_hash: bytes) -> None:
        """Mark the segment holding ``block_hash`` most recently used."""
        e = self.entries.get(block_hash)
        if e is not None and e.segment in self.segments:
            self.segments.move_to_end(e.segment)

    def clear(self) -> list[RecordMeta]:
        """Delete every segment, foreign ones included; returns the dropped blocks' metadata."""
        out = []
        for seg_id in list(self.segments):
            out.extend(self._delete_segment(seg_id))
        self.entries.clear()
        while self.foreign:
            _, seg = self.foreign.popitem(last=False)
            self.used_bytes -= seg.size
            _unlink(seg.path)
        return out

    def read(self, entries: list[DiskEntry]) -> list[memoryview]:
        """Read and verify the payloads of ``entries`` (in order).

        Records adjacent in one segment are read with one ``pread``.

        Returns:
            one payload per entry.

        Raises:
            SegmentReadError: entry ``index`` could not be read or failed a
                check (header re-parsed against the index, payload checksum);
                entries before it were fine.
        """
        out: list[memoryview] = []
        i = 0
        while i < len(entries):
            e0 = entries[i]
            seg = self.segments.get(e0.segment)
            if seg is None or self.entries.get(e0.meta.block_hash) is not e0:
                raise SegmentReadError("block left the disk tier", i, e0.segment, damaged=False)
            j, end = i + 1, e0.offset + e0.meta.record_len
            while j < len(entries) and entries[j].segment == e0.segment and entries[j].offset == end:
                end += entries[j].meta.record_len
                j += 1
            try:
                fd = os.open(seg.path, _OPEN_EXISTING)
                try:
                    st = os.fstat(fd)
                    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                        # replaced since it was indexed (a folder others can write)
                        raise OSError(f"{_foreign_owner(st)}; not loaded")
                    data = os.pread(fd, end - e0.offset, e0.offset)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise SegmentReadError(f"cannot read {seg.path}: {exc}", i, e0.segment) from None
            mv = memoryview(data)
            pos = 0
            for k in range(i, j):
                e = entries[k]
                try:
                    meta = parse_header(mv[pos:])
                    if meta != e.meta:
                        raise RecordError("record differs from the indexed one")
                    start = pos + HEADER_BYTES + len(meta.token_bytes)
                    payload = mv[start:start + meta.payload_len]
                    verify_payload(meta, payload)
                except RecordError as exc:
                    raise SegmentReadError(f"{seg.path} @ {e.offset}: {exc}", k, e.segment) from None
                out.append(payload)
                pos += meta.record_len
            i = j
        return out


def _write_all(fd: int, bufs: list) -> None:
    """Write every buffer, in order, with ``writev`` (at most 512 buffers per call)."""
    iov_max = 512
    pending = deque(memoryview(b).cast("B") for b in bufs)
    while pending:
        n = os.writev(fd, list(itertools.islice(pending, iov_max)))
        # drop fully written buffers, trim a partially written one
        while n and pending:
            if n >= len(pending[0]):
                n -= len(pending.popleft())
            else:
                pending[0] = pending[0][n:]
                n = 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: File in a disk tier's directory that its owner holds an exclusive ``flock`` on.
LOCK_NAME = ".kvmesh-disk.lock"


def _lock_directory(directory: str):
    """Take the directory's lock (``flock(2)``, released by the kernel when the holder
    exits, even on SIGKILL); returns the open lock file, which holds it until closed.

    Raises:
        ValueError: the lock is held (the message names the directory and the holder's pid).
    """
    import errno
    import fcntl

    path = os.path.join(directory, LOCK_NAME)
    try:  # never through a symlink planted in a shared folder
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ValueError(f"disk_dir {directory}: cannot open its lock file {LOCK_NAME} ({exc.strerror}); give "
                         "the worker a folder of its own") from None
    f = open(fd, "r+", encoding="ascii", errors="replace")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # a file system without flock (some NFS and FUSE mounts): run unlocked, and say so
            log.warning("disk tier %s: cannot lock the folder (%s); make sure no other worker uses it",
                        directory, exc.strerror)
            return f
        f.seek(0)
        holder = f.read(32).strip() or "?"
        f.close()
        raise ValueError(f"disk_dir {directory} is in use by another worker (pid {holder}): two workers in one "
                         "directory would overwrite and delete each other's segments; give each worker its own "
                         "disk_dir (kvmesh up uses DIR/<worker id>)") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def others_may_write(mode: int) -> bool:
    """Whether a folder of ``mode`` lets every user of the machine delete or rename the files
    in it: writable by others (``o+w``) without the sticky bit (``+t``, as /tmp has)."""
    return mode & (stat.S_IWOTH | stat.S_ISVTX) == stat.S_IWOTH


def _foreign_owner(st: os.stat_result) -> str:
    return (f"owned by uid {st.st_uid}, not this worker's ({os.geteuid()})" if st.st_uid != os.geteuid()
            else "not a regular file")


class _NotOurs(Exception):
    """A directory entry named like a segment that is not a regular file, or cannot be opened
    (``args[0]`` says which); it is left alone."""


_KINDS = {stat.S_IFREG: "file", stat.S_IFLNK: "symlink", stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


def _kind(path: str) -> str | None:
    """What ``path`` itself is, links not followed: "file" for a regular file, "symlink",
    "directory", "FIFO", ...; None when it does not exist."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return _KINDS.get(stat.S_IFMT(mode), "special file")


def _unlink(path: str) -> None:
    """Delete ``path``; a file already gone is fine, and an entry that cannot be deleted (swapped
    for a directory since it was checked, permissions) is logged and left, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("disk tier: could not delete %s (%s); left in place", path, exc.strerror or exc)
