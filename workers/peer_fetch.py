"""Fetching a request's cached prefix from the peer worker that holds it.

When the router sends a request to a worker other than the one holding its
prefix (the holder was overloaded), it names the holder in
``GenerateRequest.prefix_location``. Before queueing the request, the worker
asks :class:`PeerFetcher` whether pulling the blocks it lacks is faster than
computing them:

* **recompute time** = tokens to fetch / the engine's measured prefill rate
  (``Engine.prefill_tokens_per_s``: an EWMA over its own prefill steps);
* **transfer time** = ``latency + bytes / bandwidth`` from a per-peer
  :class:`TransferModel`, EWMAs of past fetches from that peer (time to the
  first block, then throughput over the rest).

In ``auto`` mode the fetch happens only when the transfer estimate is below
the recompute estimate. A peer with no history gets a fetch whose first blocks
are the probe: once `PROJECT_AFTER_BLOCKS` blocks have arrived the worker projects
the finishing time from the pace of the blocks since the first and stops early if
it would miss the deadline (`FetchPace`), leaving the longest interval out, so that one
late block on a busy host does not end a fetch that would have finished in time.

Every fetch has a deadline: the recompute estimate (in ``auto``; past it a
fetch cannot win any more), capped by ``max_fetch_s`` and by the request's own
deadline. When it passes, the stream is cancelled and the request recomputes
what did not arrive; blocks that arrived verified before it are kept. Nothing
waits unbounded: an unreachable peer fails fast, a silent one hits the deadline.

Verification (``block_record``): every block's hash must be the request's hash
at that position, its parent the previous hash, its tokens the request's
tokens, the hash must recompute from them, its layout must match this pool and
its payload its checksum. The first block that fails ends the fetch. Verified
blocks go to the tier store's staging area, where the scheduler finds them as
the ``peer`` medium.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvmesh.cache_store.block_record import RECORD_FORMAT_VERSION, RecordError, RecordMeta, verify_payload
from kvmesh.cache_store.fresh_thread import to_fresh_thread
from kvmesh.cache_store.hashing import hash_blocks
from kvmesh.workers.grpc_host import ChannelPool

__all__ = ["TransferModel", "FetchDecision", "PeerFetcher", "FETCH_MODES", "decide", "FetchPace",
           "MAX_FETCH_BLOCKS", "PROJECT_AFTER_BLOCKS"]

log = logging.getLogger(__name__)

#: Peer-fetch modes of a worker.
FETCH_MODES = ("auto", "never", "always")
#: Most blocks one FetchBlocks call may ask for.
MAX_FETCH_BLOCKS = 4096
#: Blocks an ``auto`` fetch receives before it projects its finishing time (three
#: intervals after the first block, which also carries the call's latency).
PROJECT_AFTER_BLOCKS = 4


class TransferModel:
    """Measured cost of pulling blocks from one peer: ``latency_s + nbytes / bytes_per_s``.

    Both terms are EWMAs (weight ``alpha`` for the newest fetch): ``latency_s`` of the
    time from the call to the first block, ``bytes_per_s`` of the throughput after it.
    A fetch that failed or timed out before its first block makes the estimate infinite
    for ``ttl_s`` seconds: an unreachable or silent peer is not asked again (and nobody
    waits for it again) until its history expires and it gets probed afresh.
    """

    def __init__(self, alpha: float = 0.3, ttl_s: float = 30.0):
        self.alpha = alpha
        self.ttl_s = ttl_s
        self.latency_s: float | None = None
        self.bytes_per_s: float | None = None
        self.updated = 0.0
        self.failed_at: float | None = None

    def estimate(self, nbytes: int, now: float | None = None) -> float | None:
        """Seconds to fetch ``nbytes`` bytes; None without history (or history older than
        ``ttl_s``); ``inf`` within ``ttl_s`` of a fetch that got no block.

        With a latency but no bandwidth sample yet, the latency alone is returned (a lower bound).
        """
        now = time.monotonic() if now is None else now
        if now - self.updated > self.ttl_s:
            return None
        if self.failed_at is not None:
            return float("inf")
        if self.latency_s is None:
            return None
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def observe(self, first_s: float | None, rest_bytes: int, rest_s: float, failed_after_s: float | None = None,
                now: float | None = None) -> None:
        """Record one fetch: seconds to the first block, then bytes and seconds for the rest."""
        self.updated = time.monotonic() if now is None else now
        a = self.alpha
        if first_s is None:
            self.failed_at = self.updated
            return
        self.failed_at = None
        lat = first_s
        if lat is not None:
            self.latency_s = lat if self.latency_s is None else self.latency_s + a * (lat - self.latency_s)
        if rest_bytes > 0 and rest_s > 0:
            bw = rest_bytes / rest_s
            self.bytes_per_s = bw if self.bytes_per_s is None else self.bytes_per_s + a * (bw - self.bytes_per_s)


@dataclass(frozen=True)
class FetchDecision:
    """Whether to fetch, with what deadline (seconds from now), and why."""

    fetch: bool
    deadline_s: float
    reason: str
    est_transfer_s: float | None
    est_recompute_s: float


def decide(mode: str, nbytes: int, ntokens: int, prefill_tokens_per_s: float, model: TransferModel,
           max_fetch_s: float, time_left_s: float | None) -> FetchDecision:
    """Pure fetch decision for ``nbytes`` bytes (``ntokens`` tokens) of missing prefix.

    Raises:
        ValueError: unknown mode.
    """
    if mode not in FETCH_MODES:
        raise ValueError(f"peer fetch mode must be one of {FETCH_MODES}, got {mode!r}")
    recompute = ntokens / max(prefill_tokens_per_s, 1e-9)
    est = model.estimate(nbytes)
    cap = max_fetch_s if time_left_s is None else min(max_fetch_s, max(0.0, time_left_s))
    if mode == "never" or ntokens <= 0:
        return FetchDecision(False, 0.0, "disabled" if mode == "never" else "nothing to fetch", est, recompute)
    if mode == "always":
        return FetchDecision(cap > 0, cap, "always", est, recompute)
    deadline = min(cap, recompute)
    if est is not None and est >= recompute:
        return FetchDecision(False, 0.0, "transfer slower than recompute", est, recompute)
    return FetchDecision(deadline > 0, deadline, "probe" if est is None else "transfer faster", est, recompute)


class FetchPace:
    """Block arrival times of one fetch in progress, and the finishing time they project.

    The pace is the mean interval between blocks after the first (whose own time includes
    the call's latency), leaving out the single longest interval: one block held up on a
    busy host does not make a fast peer look slow, and a peer that is slow throughout still
    projects slow. Nothing is projected before `PROJECT_AFTER_BLOCKS` blocks have arrived.
    """

    def __init__(self):
        self.received = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.longest_gap = 0.0

    def arrived(self, now: float) -> None:
        """One more block arrived at ``now`` (monotonic seconds)."""
        if self.first_at is None:
            self.first_at = now
        else:
            self.longest_gap = max(self.longest_gap, now - self.last_at)
        self.last_at = now
        self.received += 1

    def past_deadline(self, expected: int, deadline: float) -> bool:
        """Whether the remaining ``expected - received`` blocks, at this pace, arrive after
        ``deadline`` (monotonic seconds); False until `PROJECT_AFTER_BLOCKS` have arrived
        (or when all have)."""
        if self.received < min(PROJECT_AFTER_BLOCKS, expected) or self.received >= expected:
            return False
        per_block = max(self.last_at - self.first_at - self.longest_gap, 0.0) / (self.received - 2)
        return self.last_at + (expected - self.received) * per_block > deadline


@dataclass
class FetchResult:
    """What a fetch did: blocks staged, bytes received, seconds spent, why it ended."""

    staged: int = 0
    received: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    outcome: str = ""
    decision: FetchDecision | None = None


class PeerFetcher:
    """Pulls prefix blocks from peers over ``kvmesh.v1.Worker/FetchBlocks`` into an engine's staging area.

    Args:
        engine: the worker's `Engine` (needs a tier store with a staging area).
        mode: "auto", "never" or "always" (see the module doc).
        max_fetch_s: longest any fetch may take (seconds).
        channel_factory: ``address -> grpc.aio.Channel`` (cached per address).

    Raises:
        ValueError: unknown mode or non-positive ``max_fetch_s``.
    """

    def __init__(self, engine, mode: str = "auto", max_fetch_s: float = 2.0, channel_factory=None, tls=None,
                 holder_check=None):
        if mode not in FETCH_MODES:
            raise ValueError(f"peer fetch mode must be one of {FETCH_MODES}, got {mode!r}")
        if not max_fetch_s > 0:
            raise ValueError("max_fetch_s must be > 0 seconds")
        self.engine = engine
        self.mode = mode
        self.max_fetch_s = float(max_fetch_s)
        self.models: dict[str, TransferModel] = {}
        self._channels = ChannelPool(channel_factory, tls=tls)  # mutual TLS to peers with a TlsConfig
        #: ``holder_check(worker_id, address) -> bool`` (blocking): whether the holder has a
        #: current lease in the cluster at that address; None trusts every holder
        self.holder_check = holder_check
        self.last: FetchResult | None = None

    def _channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def close(self) -> None:
        await self._channels.close()

    async def fetch_prefix(self, prompt_ids: list[int], namespace, address: str, holder_blocks: int,
                           time_left_s: float | None = None, holder_id: str = "") -> FetchResult:
        """Fetch the blocks of ``prompt_ids`` this worker lacks from the holder at ``address``.

        Args:
            prompt_ids: the request's prompt.
            namespace: its `cache_store.hashing.Namespace`.
            address: holder's host:port.
            holder_blocks: leading blocks the holder is known to have.
            time_left_s: the request's remaining deadline (seconds), if any.
            holder_id: the holder's worker id, checked with ``holder_check`` (no fetch from a
                worker without a current lease at ``address``).

        Returns:
            a `FetchResult` (``staged`` blocks are now in the staging area). Never raises
            for network or peer errors; they end the fetch and the request recomputes.
        """
        engine = self.engine
        tiers = engine.tiers
        res = FetchResult(outcome="no staging area")
        if tiers is None or tiers.peer is None or not address:
            return self._done(res)
        if self.holder_check is not None:
            try:
                leased = await asyncio.to_thread(self.holder_check, holder_id, address)
            except Exception as exc:  # Redis unreachable: no proof of a lease, so no fetch
                log.warning("peer fetch: lease of %s not checked (%s); recomputing", holder_id, exc)
                leased = False
            if not leased:
                res.outcome = "holder has no current lease"
                log.warning("peer fetch: %s at %s holds no current lease in the cluster; not fetching",
                            holder_id or "holder", address)
                return self._done(res)
        res.outcome = ""
        bs = engine.block_size
        root = namespace.root_hash()
        hashed = hash_blocks(prompt_ids, bs, root)
        want = min(int(holder_blocks), (len(prompt_ids) - 1) // bs, MAX_FETCH_BLOCKS)
        tokens_of = hashed.block_tokens
        local = await asyncio.to_thread(engine.local_prefix_blocks, hashed.hashes, tokens_of, root, want)
        missing = want - local
        block_bytes = tiers.codec("none").payload_bytes
        rate = await asyncio.to_thread(engine.prefill_tokens_per_s)
        model = self.models.setdefault(address, TransferModel())
        dec = decide(self.mode, missing * block_bytes, missing * bs, rate, model, self.max_fetch_s, time_left_s)
        res.decision = dec
        if not dec.fetch:
            res.outcome = dec.reason if missing > 0 else "held locally"
            return self._done(res)
        verified: list[tuple[RecordMeta, bytes]] = []
        t0 = time.monotonic()
        first_at: float | None = None
        deadline = t0 + dec.deadline_s
        pace = FetchPace()
        expected = len(hashed.hashes[local:want])
        call = None
        try:
            from kvmesh.proto import kvmesh_pb2 as pb
            from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

            stub = pb_grpc.WorkerStub(self._channel(address))
            call = stub.FetchBlocks(pb.FetchBlocksRequest(block_hashes=hashed.hashes[local:want],
                                                          kv_producer=getattr(self.engine, "kv_producer", "")),
                                    timeout=max(dec.deadline_s, 1e-3))
            pos = local
            async for msg in call:
                now = time.monotonic()
                if first_at is None:
                    first_at = now
                res.received += 1
                res.nbytes += len(msg.payload)
                rec = _verify(msg, pos, hashed, root, engine)
                verified.append(rec)
                pos += 1
                if pos >= want:
                    break
                pace.arrived(now)
                if self.mode == "auto" and pace.past_deadline(expected, deadline):
                    res.outcome = "projected past deadline"
                    break
            res.outcome = res.outcome or ("complete" if pos >= want else "holder has fewer blocks")
        except RecordError as exc:
            res.outcome = f"verification failed: {exc}"
            log.warning("peer fetch from %s: %s", address, exc)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            res.outcome = "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"rpc error {code.name}"
        except Exception as exc:  # any other failure must not fail the request: recompute instead
            log.exception("peer fetch from %s failed", address)
            res.outcome = f"error: {exc}"
        finally:
            if call is not None:
                call.cancel()
        end = time.monotonic()
        res.seconds = end - t0
        if first_at is None:
            model.observe(None, 0, 0.0, failed_after_s=res.seconds)
        else:
            model.observe(first_at - t0, res.nbytes - (len(verified[0][1]) if verified else 0), end - first_at)
        if verified:
            try:
                res.staged = await to_fresh_thread(tiers.stage, verified, owner=namespace.tenant or None,
                                                   name="kvmesh-stage")
            except RecordError as exc:
                res.outcome = f"not staged: {exc}"
        return self._done(res)

    def _done(self, res: FetchResult) -> FetchResult:
        self.last = res
        log.info("peer fetch: %s, staged %d block(s), %.1f ms", res.outcome, res.staged, 1000 * res.seconds)
        return res


def _verify(msg, pos: int, hashed, root: bytes, engine) -> tuple[RecordMeta, bytes]:
    """Check one received block against position ``pos`` of the request's chain."""
    if msg.format_version != RECORD_FORMAT_VERSION:
        raise RecordError(f"unsupported block format version {msg.format_version}")
    meta = RecordMeta(bytes(msg.block_hash), bytes(msg.parent_block_hash), bytes(msg.token_ids), msg.codec,
                      msg.dtype, tuple(msg.shape), len(msg.payload), int(msg.checksum))
    tiers = engine.tiers
    parent = hashed.hashes[pos - 1] if pos > 0 else None
    meta.verify_for(hashed.hashes[pos], parent, hashed.block_tokens(pos), root, tiers.dtype_name, tiers.block_shape)
    tiers.check_codec(meta)  # a lossy block only where this worker's own tiers accept that codec
    if len(msg.payload) != tiers.codec(meta.codec).payload_bytes:
        raise RecordError("payload size does not match its codec")
    verify_payload(meta, msg.payload)
    return meta, bytes(msg.payload)
