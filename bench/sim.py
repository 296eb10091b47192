"""Cluster simulator: replays a Mooncake trace through the real routing code, no model.

Each simulated worker is the worker's own `PrefixCache` (block pool + radix index, LRU
eviction of chain tails first) sized in trace blocks, plus a FIFO queue served one
request at a time. The router is the service's own code: `ClusterIndex` fed by the
workers' KV events (applied as soon as a request's blocks are committed) and a policy
from `services.policies`, given the same `WorkerView` fields the live router builds.

Unit of caching: one trace block (``hash_ids`` entry, 512 tokens in the trace). A
request's blocks are its hash_ids, all counted, the partial tail included (as the
published block-weighted hit rates count them).

Cost model (seconds), calibrated from the engine (see `calibrate`)::

    prefill = prefill_s_per_token * computed_prefill_tokens      (one prefill at a time per worker)
    decode  = decode_s_per_step * output_tokens                  (batched: runs beside later prefills)

TTFT = time queued behind earlier prefills + own prefill; a request's end = TTFT + decode.
"""
from __future__ import annotations

import heapq
import math
import random
import struct
from collections import deque
from dataclasses import dataclass, field

from cache_store.events import EventBatch
from cache_store.prefix_cache import PrefixCache
from services.cluster_index import ClusterIndex, weighted_blocks
from services.policies import RoutedShare, RouteRequest, WorkerView, make_policy

TRACE_BLOCK_TOKENS = 512


@dataclass
class CostModel:
    """Seconds per prefill token and per decode step of one worker."""

    prefill_s_per_token: float = 1 / 3000.0
    decode_s_per_step: float = 0.02


@dataclass
class _Job:
    idx: int
    hashes: list[bytes]
    tokens: bytes
    num_tokens: int
    output_tokens: int
    arrival: float
    cached_blocks: int = 0
    prefill_tokens: int = 0
    start: float = 0.0
    client: int = -1


@dataclass
class _SimWorker:
    worker_id: str
    cache: PrefixCache
    queue: deque = field(default_factory=deque)
    busy: _Job | None = None
    queued_prefill: int = 0
    running: int = 0
    seq: int = 0
    num_requests: int = 0


def _block_hash(hash_id: int) -> bytes:
    return struct.pack("<QQ", hash_id & 0xFFFFFFFFFFFFFFFF, 0x6B766D657368)  # "kvmesh" tag


class _Chain:
    """`BlockHashes`-shaped view of a trace request: one block per hash_id (block_size 1)."""

    __slots__ = ("hashes", "token_bytes", "block_size")

    def __init__(self, hashes: list[bytes], token_bytes: bytes):
        self.hashes = hashes
        self.token_bytes = token_bytes
        self.block_size = 1

    def block_tokens(self, i: int) -> bytes:
        return self.token_bytes[4 * i:4 * i + 4]


def simulate(reqs, policy: str, num_workers: int, capacity_tokens: int, block_tokens: int = TRACE_BLOCK_TOKENS,
             concurrency: int | None = None, time_scale: float = 1.0, cost: CostModel | None = None,
             max_output_tokens: int | None = None, seed: int = 0) -> dict:
    """Replay ``reqs`` (`bench.trace.TraceRequest`) through ``policy`` on ``num_workers``.

    Args:
        capacity_tokens: KV capacity of each worker in tokens (``pooled`` gets the sum).
        block_tokens: tokens one trace block stands for (512 = the trace's own size).
        concurrency: closed loop with this many clients; None = open loop at the trace's
            timestamps divided by ``time_scale``.

    Returns:
        ``hit_rate_blocks``, ``hit_rate_tokens``, ``ttft_ms`` {p50, p99}, ``imbalance``
        (max over mean of per-worker request counts), ``prefill_tokens_saved``,
        ``num_requests``, ``worker_requests``.
    """
    cost = cost or CostModel()
    pooled = policy == "pooled"
    n_workers = 1 if pooled else num_workers
    cap_blocks = max(1, capacity_tokens * (num_workers if pooled else 1) // block_tokens)
    index = ClusterIndex()
    workers: list[_SimWorker] = []
    for i in range(n_workers):
        w = _SimWorker(f"w{i}", None)  # type: ignore[arg-type]
        w.cache = PrefixCache(cap_blocks, 1, event_sink=_sink(index, w))
        workers.append(w)
    pol = None if pooled else make_policy(policy)
    routed = RoutedShare()
    rng = random.Random(seed)
    events: list = []  # (time, order, kind, payload)
    order = 0
    jobs = []
    for i, r in enumerate(reqs):
        hashes = [_block_hash(h) for h in r.hash_ids]
        out = r.output_length if max_output_tokens is None else min(r.output_length, max_output_tokens)
        n_tok = r.input_length * block_tokens // TRACE_BLOCK_TOKENS
        jobs.append(_Job(i, hashes, struct.pack(f"<{len(r.hash_ids)}I", *[h & 0xFFFFFFFF for h in r.hash_ids]),
                         max(1, n_tok), out, r.timestamp_ms / 1000.0 / time_scale))
    if concurrency is None:
        for j in jobs:
            heapq.heappush(events, (j.arrival, order, 0, j))
            order += 1
        pending = deque()
    else:
        pending = deque(jobs)
        for c in range(min(concurrency, len(jobs))):
            j = pending.popleft()
            j.arrival = 0.0
            j.client = c
            heapq.heappush(events, (0.0, order, 0, j))
            order += 1
    ttfts: list[float] = []
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0

    def start_next(w: _SimWorker, now: float) -> None:
        nonlocal order
        if w.busy is not None or not w.queue:
            return
        j = w.queue.popleft()
        w.busy = j
        j.start = now
        held = list(w.cache.index.match(j.hashes, _Chain(j.hashes, j.tokens).block_tokens).values)
        j.cached_blocks = len(held)
        w.cache.lock(held)
        chain = _Chain(j.hashes, j.tokens)
        new = w.cache.allocate(len(j.hashes) - len(held))
        if new is not None:
            ids = held + new
            w.cache.commit(chain, ids, len(held), len(j.hashes))
            w.cache.unlock(ids)
        else:
            w.cache.unlock(held)
        cached_tok = min(j.num_tokens - 1, j.cached_blocks * block_tokens)
        computed = j.num_tokens - cached_tok
        w.queued_prefill = max(0, w.queued_prefill - j.prefill_tokens)
        prefill_s = computed * cost.prefill_s_per_token
        ttfts.append((now + prefill_s - j.arrival) * 1000.0)
        # the worker's prefill stream is busy for prefill_s; decode runs batched beside it
        heapq.heappush(events, (now + prefill_s, order, 1, (w, None, 0)))
        order += 1
        heapq.heappush(events, (now + prefill_s + j.output_tokens * cost.decode_s_per_step, order, 2,
                                (w, j, cached_tok)))
        order += 1

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:  # arrival: route
            j = payload
            if pooled:
                w = workers[0]
                matched = 0
            else:
                matches = index.match(j.hashes, now)
                views = []
                for w in workers:
                    m = matches.get(w.worker_id)
                    views.append(WorkerView(
                        worker_id=w.worker_id, address="", matched_blocks=m.num_blocks if m else 0,
                        weighted_blocks=weighted_blocks(m) if m else 0.0,
                        running_requests=w.running, waiting_requests=len(w.queue),
                        queued_prefill_tokens=w.queued_prefill, free_blocks=w.cache.pool.num_free_blocks,
                        total_blocks=cap_blocks,
                        routed_recent=routed.value(w.worker_id)))
                # request in kvmesh blocks: scale so block_size * blocks ~ tokens
                chosen = pol.choose(RouteRequest(j.num_tokens, j.hashes, block_tokens), views, rng)
                w = next(x for x in workers if x.worker_id == chosen.worker_id)
                matched = chosen.matched_blocks
                index.add_speculative(w.worker_id, j.hashes, now)
                routed.note(w.worker_id)
            j.prefill_tokens = max(1, j.num_tokens - matched * block_tokens)
            w.queued_prefill += j.prefill_tokens
            w.num_requests += 1
            w.queue.append(j)
            w.running += 1
            start_next(w, now)
        elif kind == 1:  # prefill done: the worker takes the next queued request
            w = payload[0]
            w.busy = None
            start_next(w, now)
        else:  # request finished (last token)
            w, j, cached_tok = payload
            w.running -= 1
            hit_blocks += j.cached_blocks
            total_blocks += len(j.hashes)
            hit_tokens += cached_tok
            total_tokens += j.num_tokens
            if concurrency is not None and pending:
                nj = pending.popleft()
                nj.arrival = now
                heapq.heappush(events, (now, order, 0, nj))
                order += 1
    counts = [w.num_requests for w in workers]
    ttfts.sort()
    pct = (lambda p: ttfts[min(len(ttfts) - 1, int(round(p / 100 * (len(ttfts) - 1))))] if ttfts else 0.0)
    return {
        "policy": policy,
        "num_requests": len(jobs),
        "hit_rate_blocks": hit_blocks / max(1, total_blocks),
        "hit_rate_tokens": hit_tokens / max(1, total_tokens),
        "ttft_ms": {"p50": round(pct(50), 3), "p99": round(pct(99), 3)},
        "imbalance": max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else 0.0,
        "prefill_tokens_saved": hit_tokens,
        "worker_requests": {w.worker_id: w.num_requests for w in workers},
    }


def _sink(index: ClusterIndex, w: _SimWorker):
    def sink(event) -> None:
        w.seq += 1
        index.apply_batch(EventBatch(w.worker_id, w.seq, 0.0, [event]))
    return sink
