"""Cluster simulator: ``kvmesh sim`` replays a Mooncake trace through the service's routing code.

No model runs. What is simulated is time; what is *not* simulated is the code that decides:
every worker is the worker's own `cache_store.prefix_cache.PrefixCache` (block pool + radix
index, leaf-first LRU eviction), its KV events feed the router's own
`services.cluster_index.ClusterIndex`, and each request is routed by a policy from the
`services.policies` registry (``make_policy``), given the same `WorkerView` fields, the same
`RoutedShare` counts and the same speculative index entries as `services.router`.

Cache blocks
------------
Two granularities, picked by ``block_size``:

* ``block_size=None`` (the default, the trace at its real size): one cache block per trace
  block (``hash_ids`` entry), standing for ``block_tokens`` tokens (512 in the trace). A
  request's blocks are all its hash ids, the partial tail included, and all may hit: this
  is how the published block-weighted hit rates of the trace count (105,710 of 288,500
  block references hit an unbounded cache). Capacity: ``capacity_tokens // block_tokens``
  blocks per worker.
* ``block_size=B`` (the live cluster's setting): prompts are synthesized with
  `bench.trace.synthesize_tokens` (``block_tokens`` tokens per trace block) and hashed with
  `cache_store.hashing.hash_blocks` in blocks of ``B`` tokens, exactly as the router and the
  workers do. As in the engine, a hit covers at most ``floor((L - 1) / B)`` blocks, a request
  allocates blocks for its prompt and output, and only full prompt blocks are cached.
  ``hit_rate_blocks`` counts the trace blocks whose tokens are all cached, as
  `bench.report` does for a live run.

Workers and time
----------------
Each worker has one prefill stream served in arrival order and decodes beside it (decode is
batched with other work, so it does not hold the stream). A request's life:

1. **Arrival** (the trace timestamp, every gap multiplied by ``time_scale``, or, with ``concurrency=K``, a
   closed loop of K clients as in ``kvmesh bench``): the policy chooses a worker from the
   views; the router's bookkeeping follows (`RoutedShare.note`, a speculative index entry for
   2 s, the estimated prefill ``N - B * matched`` added to the worker's queued prefill).
2. **Prefill start** (its stream is free): the worker matches its own cache, locks the hit
   and allocates the rest (if the pool has no room the request runs uncached).
3. **Prefill end** after ``prefill_s_per_token * computed_tokens`` seconds: its blocks are
   committed (KV events reach the index at once), TTFT = prefill end - arrival.
4. **Finish** after ``decode_s_per_step * output_tokens`` more seconds: its blocks are
   released (chain tails first) and stay cached until evicted.

With ``peer_fetch`` (`PeerFetch`, ``--peer-fetch-gbps``), step 1 also does what kvmesh's
router and worker do when the chosen worker lacks blocks another one holds: the router names
that holder and the worker fetches the blocks the holder's cache has now, if the transfer
beats recomputing them, before the request joins its queue. The fetched blocks are a hit of
the ``peer`` medium at step 2 if they still join the worker's own hit; they count in
``peer_hit_rate_*``, not in the hit rates of the worker's own cache.

Cost model (`CostModel`)::

    prefill_s = prefill_s_per_token * (prompt_tokens - cached_tokens)
    decode_s  = decode_s_per_step  * output_tokens

The defaults are planning constants for a GPU-class worker, not a measurement: 12,000
prefill tokens/s and 30 ms per decode step, in the range of an 8B-parameter dense model in
bf16 on one H100-class GPU. A prompt token costs about 2 x 8e9 = 16 GFLOP, so 12,000
tokens/s is about 190 TFLOP/s, a fifth of the H100 SXM's dense BF16 peak (989 TFLOP/s,
NVIDIA's datasheet); a decode step of a batch of long-context sequences reads the 16 GB of
weights plus their KV, tens of GB at its 3.35 TB/s. A prompt whose trace blocks are all
cached still computes one token. `calibrate` measures both constants on this machine's
engine instead (``kvmesh sim --calibrate``).

``pooled`` is not a router: one cache holding all workers' capacity, served by as many
prefill streams from one shared queue, the reference a router's hit rate is measured
against. Its streams share prefixes in flight, as the engine does: a request whose next
uncached block is being computed by a running prefill waits, without taking a stream, until
that prefill commits; it then hits those blocks and computes only the rest of its prompt
(its TTFT includes the wait). Without this, requests with a common prefix that arrive
together would each compute it on their own stream, where a router that queues them on one
worker hits. A routed worker has one prefill stream in arrival order, so a request starts
only after the previous prefill has committed and the rule never applies there (a worker
with several streams applies it too). With ``unbounded``, pooled hits every block an earlier
request has computed or is computing, the infinite-cache hit rate, and no router exceeds it.
With a bounded capacity it is not a strict bound: LRU is not an optimal eviction order, and
a router whose partitions shield some conversations from others' churn can occasionally
beat it.

Reported per policy: ``hit_rate_blocks``, ``hit_rate_tokens``, ``ttft_ms`` {p50, p99},
``imbalance`` (max over mean of per-worker request counts), ``prefill_tokens_saved``, and
``sim_seconds`` (wall time of the replay).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import shlex
import signal
import statistics
import struct
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvmesh.cache_store.events import EventBatch
from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.cache_store.prefix_cache import PrefixCache
from kvmesh.services.cli_checks import positive_float, positive_int
from kvmesh.services.cluster_index import ClusterIndex, weighted_blocks
from kvmesh.services.policies import (POLICIES, RoutedShare, RouteRequest, RoutingPolicy, WorkerView, make_policy,
                                      prefix_holder)
from kvmesh.services.shortlist import shortlist

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "POOLED",
    "DEFAULT_POLICIES",
    "DEFAULT_TRACE",
    "SPECULATIVE_TTL_S",
    "CostModel",
    "PeerFetch",
    "Workload",
    "calibrate",
    "prepare",
    "simulate",
    "simulate_live",
    "run_policies",
    "results_markdown",
    "summary",
    "main",
    "register",
]

#: Tokens per block in the Mooncake traces.
TRACE_BLOCK_TOKENS = 512
#: Name of the reference layout: one shared cache of all workers' capacity (not a routing policy).
POOLED = "pooled"
#: Lifetime of the router's speculative index entries (s); equal to
#: ``services.router.SPECULATIVE_TTL_S`` (a test keeps them equal).
SPECULATIVE_TTL_S = 2.0
#: Policies of a default run: the reference first, then kvmesh's, the field's, and the baselines.
DEFAULT_POLICIES = (POOLED, "kv_aware", "dynamo_kv", "llmd_precise", "sglang_cache_aware", "ray_prefix_affinity",
                    "prefix", "least_loaded", "power_of_two", "round_robin", "random")
#: The full Mooncake conversation trace shipped in the repository (see bench/data/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
#: Mooncake's synthetic trace (long documents asked about again, short chats; bench/data/README.md).
SYNTHETIC_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"

_ARRIVE, _PREFILL_DONE, _FINISH, _FETCHED = 0, 1, 2, 3


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """Seconds per computed prefill token and per decode step of one worker.

    Defaults: a GPU-class worker (see the module docstring); `calibrate` measures them.
    """

    prefill_s_per_token: float = 1 / 12000.0
    decode_s_per_step: float = 0.03

    def __post_init__(self):
        if not (self.prefill_s_per_token > 0 and self.decode_s_per_step >= 0):
            raise ValueError("prefill_s_per_token must be > 0 and decode_s_per_step >= 0")


@dataclass(frozen=True)
class PeerFetch:
    """What fetching a prefix from the worker the router names costs (kvmesh's peer tier).

    When the chosen worker lacks blocks another worker holds, kvmesh's router names that
    holder in ``prefix_location`` (`services.policies.prefix_holder`, for every policy) and
    the worker pulls the blocks before queueing the request (`workers.peer_fetch`): the
    fetch does not occupy its prefill stream, and what arrives is a hit of the ``peer``
    medium. As the worker's ``auto`` mode, a fetch happens only when::

        transfer_s = latency_s + fetched_tokens * kv_bytes_per_token / bytes_per_s

    is below the recompute time (``prefill_s_per_token * fetched_tokens``), and it stops at
    ``max_fetch_s`` (``--peer-fetch-max-s``) with the blocks that arrived by then.

    ``kv_bytes_per_token`` defaults to an 8B Llama-3-shaped model in bf16 (32 layers x 8 KV
    heads x 128 dims x 2 (K and V) x 2 bytes = 131,072 bytes, as Llama-3-8B's config.json);
    there is no default bandwidth: pass the fleet's (``kvmesh sim --peer-fetch-gbps``).

    Raises:
        ValueError: a non-positive size, bandwidth or cap, or a negative latency.
    """

    bytes_per_s: float
    kv_bytes_per_token: int = 131072
    latency_s: float = 0.002
    max_fetch_s: float = 2.0

    def __post_init__(self):
        if not (self.bytes_per_s > 0 and self.kv_bytes_per_token > 0 and self.max_fetch_s > 0
                and self.latency_s >= 0):
            raise ValueError("peer fetch needs bytes_per_s, kv_bytes_per_token and max_fetch_s > 0 "
                             "and latency_s >= 0")

    def tokens_within(self, seconds: float) -> float:
        """Tokens of KV that arrive within ``seconds`` of the call."""
        return max(0.0, seconds - self.latency_s) * self.bytes_per_s / self.kv_bytes_per_token

    def seconds_for(self, tokens: int) -> float:
        """Seconds to fetch ``tokens`` tokens of KV."""
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bytes_per_s


def calibrate(prompt_tokens: Sequence[int] = (256, 512, 1024), decode_steps: int = 32, rounds: int = 3,
              model_dir: str | None = None, device: str = "cpu", block_size: int = 16, seed: int = 0) -> CostModel:
    """Measure the engine's prefill seconds per token and decode seconds per step.

    Runs `workers.engine.Engine` (the built-in model unless ``model_dir``) on ``device``:

    * prefill: cold prompts of each length in ``prompt_tokens`` (random token ids, the cache
      cleared before each), ``rounds`` times; ``prefill_s_per_token`` = the sum of the
      engine's ``prefill_ms`` over the sum of prompt tokens (the average cost of a token of
      a cold prefill at those lengths, per-step overheads included);
    * decode: a 16-token prompt generating ``decode_steps + 1`` tokens (``ignore_eos``),
      ``rounds`` times; ``decode_s_per_step`` = the median of
      ``(e2e_ms - ttft_ms) / decode_steps`` (one sequence per step).

    A few seconds on a CPU with the built-in model.

    Raises:
        ValueError: empty ``prompt_tokens``, or ``decode_steps`` / ``rounds`` < 1.
    """
    if not prompt_tokens or decode_steps < 1 or rounds < 1:
        raise ValueError("need at least one prompt length, decode_steps >= 1 and rounds >= 1")
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import SamplingParams

    longest = max(prompt_tokens)
    engine = Engine(model_dir=model_dir, device=device, block_size=block_size,
                    num_blocks=2 * (longest + decode_steps + 16) // block_size + 16,
                    max_num_batched_tokens=longest, max_num_seqs=4).start()
    rng = random.Random(seed)
    vocab = engine.config.vocab_size

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    try:
        engine.generate(toks(32), SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        prefill_ms = 0.0
        prefill_tokens = 0
        per_step = []
        for _ in range(rounds):
            for n in prompt_tokens:
                engine.clear_cache()
                out = engine.generate(toks(n), SamplingParams(max_tokens=1))
                prefill_ms += out["timing"]["prefill_ms"]
                prefill_tokens += n
            engine.clear_cache()
            out = engine.generate(toks(16), SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True))
            per_step.append((out["timing"]["e2e_ms"] - out["timing"]["ttft_ms"]) / decode_steps)
    finally:
        engine.stop()
    return CostModel(prefill_s_per_token=max(1e-9, prefill_ms / 1000.0 / prefill_tokens),
                     decode_s_per_step=max(0.0, statistics.median(per_step) / 1000.0))


# ----------------------------------------------------------------------------- workload
class _TraceChain:
    """`BlockHashes`-shaped view of a trace request at one cache block per hash id.

    The cache runs with ``block_size`` 1: each "token" is a trace block whose bytes are the
    low 32 bits of its hash id (the radix index verifies them on every hit).
    """

    __slots__ = ("hashes", "token_bytes", "block_size")

    def __init__(self, hashes: list[bytes], token_bytes: bytes):
        self.hashes = hashes
        self.token_bytes = token_bytes
        self.block_size = 1

    def block_tokens(self, i: int) -> bytes:
        return self.token_bytes[4 * i:4 * i + 4]


@dataclass(slots=True)
class _Spec:
    """One request, prepared once and replayed under every policy."""

    route_hashes: list[bytes]     # what the router hashes: every full cache block
    chain: object                 # BlockHashes-like, for the worker's PrefixCache
    num_tokens: int               # prompt tokens
    reuse_cap: int                # most cache blocks a hit may cover
    alloc_blocks: int             # cache blocks the request occupies while it runs
    commit_blocks: int            # leading cache blocks committed after its prefill
    output_tokens: int
    arrival_s: float              # trace arrival time (s)
    trace_blocks: int             # trace blocks of the request (denominator of the hit rate)
    block_lengths: tuple          # tokens per trace block (token mode) / per cache block (trace mode)
    cum_tokens: tuple = ()        # trace mode: tokens in the first k cache blocks, k = 0..n


@dataclass
class Workload:
    """A trace prepared for replay at one granularity (see the module docstring).

    Attributes:
        specs: one prepared request per trace line, in file order.
        block_tokens: tokens per trace block.
        block_size: tokens per cache block in token mode; None in trace mode.
    """

    specs: list
    block_tokens: int
    block_size: int | None

    @property
    def cache_block_tokens(self) -> int:
        """Tokens per cache block (the ``B`` of ``N - B * matched``)."""
        return self.block_size if self.block_size is not None else self.block_tokens

    def hit_of(self, spec: _Spec, held: int) -> tuple[int, int]:
        """(trace blocks hit, prompt tokens cached) for ``held`` cached leading blocks."""
        if self.block_size is None:
            return held, min(spec.num_tokens - 1, spec.cum_tokens[held])
        cached = held * self.block_size
        end = hit = 0
        for length in spec.block_lengths:
            end += length
            if end > cached:
                break
            hit += 1
        return hit, cached


def _trace_block_hash(hash_id: int) -> bytes:
    return struct.pack("<QQ", hash_id & 0xFFFFFFFFFFFFFFFF, 0x6B766D657368)  # "kvmesh" tag


def prepare(reqs, block_tokens: int = TRACE_BLOCK_TOKENS, block_size: int | None = None,
            max_output_tokens: int | None = None, vocab_size: int = 256) -> Workload:
    """Prepare `bench.trace.TraceRequest` s for replay (hashing is done once, not per policy).

    Args:
        block_tokens: tokens one trace block stands for (512: the trace's own size).
        block_size: None for one cache block per trace block; else the kvmesh block size
            of token mode (prompts synthesized with ``block_tokens`` tokens per trace block).
        max_output_tokens: cap on each request's output length.
        vocab_size: token id range of the synthesized prompts (token mode).

    Raises:
        ValueError: ``block_tokens`` or ``block_size`` < 1.
    """
    from kvmesh.bench.trace import block_token_lengths, synthesize_tokens

    if block_tokens < 1 or (block_size is not None and block_size < 1):
        raise ValueError("block_tokens and block_size must be >= 1")
    root = Namespace(model_id="kvmesh-sim").root_hash()
    specs = []
    for r in reqs:
        out = r.output_length if max_output_tokens is None else min(r.output_length, max_output_tokens)
        lengths = tuple(block_token_lengths(r, block_tokens))
        n_tok = sum(lengths)
        if block_size is None:
            hashes = [_trace_block_hash(h) for h in r.hash_ids]
            chain = _TraceChain(hashes, struct.pack(f"<{len(hashes)}I", *[h & 0xFFFFFFFF for h in r.hash_ids]))
            cum = [0]
            for length in lengths:
                cum.append(cum[-1] + length)
            n = len(hashes)
            specs.append(_Spec(hashes, chain, n_tok, n, n, n, out, r.timestamp_ms / 1000.0, n, lengths,
                               tuple(cum)))
        else:
            tokens = synthesize_tokens(r, block_tokens, vocab_size=vocab_size)
            bh = hash_blocks(tokens, block_size, root)
            hashes = list(bh.hashes)
            specs.append(_Spec(hashes, bh, len(tokens), (len(tokens) - 1) // block_size,
                               -(-(len(tokens) + out) // block_size), len(hashes), out, r.timestamp_ms / 1000.0,
                               len(r.hash_ids), lengths))
    return Workload(specs, block_tokens, block_size)


# ---------------------------------------------------------------------------- simulator
@dataclass(slots=True)
class _Job:
    spec: _Spec
    arrival: float
    est_prefill: int = 0
    ids: list = field(default_factory=list)
    held: int = 0
    allocated: bool = False
    fetch_from: int = 0           # peer fetch: first and end cache block staged from the holder
    fetch_to: int = 0
    peer: int = 0                 # cache blocks of the hit that came from the peer
    waiters: list = field(default_factory=list)  # requests waiting for the blocks its prefill computes


class _Worker:
    __slots__ = ("worker_id", "cache", "queue", "free_streams", "stream_counts", "inflight", "queued_prefill",
                 "seq", "capacity", "computing")

    def __init__(self, worker_id: str, capacity: int, streams: int, block_size: int, index: ClusterIndex | None):
        self.worker_id = worker_id
        self.capacity = capacity
        self.queue: deque = deque()
        self.free_streams = deque(range(streams))
        self.stream_counts = [0] * streams
        self.inflight = 0
        self.queued_prefill = 0
        self.seq = 0
        # In-flight prefix sharing, with more than one stream: the hash of each block a running
        # prefill will commit -> (that request, the block's position in its prompt). With one
        # stream a request starts only after the previous prefill has committed, so it is None.
        self.computing: dict | None = {} if streams > 1 else None
        self.cache = PrefixCache(capacity, block_size, event_sink=self._sink(index) if index is not None else None)

    def _sink(self, index: ClusterIndex) -> Callable[[object], None]:
        def sink(event) -> None:
            self.seq += 1
            index.apply_batch(EventBatch(self.worker_id, self.seq, 0.0, [event]))
        return sink


class _Routed:
    """One cache and one prefill stream per worker; a policy picks the worker."""

    def __init__(self, policy: str | RoutingPolicy, num_workers: int, capacity: int, block_size: int, policy_kwargs: dict | None):
        self.index = ClusterIndex()
        self.workers = [_Worker(f"w{i}", capacity, 1, block_size, self.index) for i in range(num_workers)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.policy = policy if isinstance(policy, RoutingPolicy) else make_policy(policy, **(policy_kwargs or {}))
        self.routed = RoutedShare()
        self.routed.set_fleet(num_workers)
        self.ids = [w.worker_id for w in self.workers]
        for wid in self.ids:
            self.routed.track(wid)

    def route(self, spec: _Spec, now: float, block: int, rng: random.Random) -> tuple[_Worker, int, _Worker | None]:
        routed_mean = common = None
        if self.policy.uses_shortlist:
            matches = shortlist(self.index, self.routed, spec.route_hashes, now, self.ids, rng)
            shown = [self.by_id[wid] for wid in matches]
            routed_mean = self.routed.total() / len(self.workers)
            widely = getattr(self.policy, "widely_held", None)
            if widely is not None:  # over the whole fleet, as a router that sees every worker counts it
                common = self.index.common_depth(spec.route_hashes, int(widely * len(self.workers)) + 1)
        else:
            matches = self.index.match(spec.route_hashes, now)
            shown = self.workers
        views = []
        for w in shown:
            m = matches.get(w.worker_id)
            views.append(WorkerView(
                worker_id=w.worker_id, address="", matched_blocks=m.num_blocks if m else 0,
                weighted_blocks=weighted_blocks(m) if m else 0.0, running_requests=w.inflight,
                waiting_requests=len(w.queue), queued_prefill_tokens=w.queued_prefill,
                free_blocks=w.cache.pool.num_free_blocks, total_blocks=w.capacity,
                routed_recent=self.routed.value(w.worker_id)))
        chosen = self.policy.choose(RouteRequest(spec.num_tokens, spec.route_hashes, block, routed_mean, common),
                                    views, rng)
        w = self.by_id[chosen.worker_id]
        self.index.add_speculative(w.worker_id, spec.route_hashes, now, SPECULATIVE_TTL_S)
        self.routed.note(w.worker_id)
        holder = prefix_holder(chosen, views)
        return w, chosen.matched_blocks, (self.by_id[holder.worker_id] if holder is not None else None)

    def counts(self) -> list[int]:
        return [w.stream_counts[0] for w in self.workers]


class _Pooled:
    """The reference: one cache of all workers' capacity, one shared queue, one stream per worker."""

    def __init__(self, policy: str, num_workers: int, capacity: int, block_size: int, policy_kwargs: dict | None):
        self.workers = [_Worker("pooled", capacity * num_workers, num_workers, block_size, None)]

    def route(self, spec: _Spec, now: float, block: int, rng: random.Random) -> tuple[_Worker, int, None]:
        w = self.workers[0]
        return w, len(w.cache.index.match(spec.route_hashes, spec.chain.block_tokens).values), None

    def counts(self) -> list[int]:
        return list(self.workers[0].stream_counts)


#: Cluster layouts by name; any other name is a routing policy run on `_Routed`.
_LAYOUTS: dict[str, type] = {POOLED: _Pooled}


def _percentile(sorted_xs: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of sorted values."""
    if not sorted_xs:
        return 0.0
    rank = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (rank - lo)


def simulate(reqs, policy: str | RoutingPolicy, num_workers: int, capacity_tokens: int | None = None, *,
             num_blocks: int | None = None, block_tokens: int = TRACE_BLOCK_TOKENS, block_size: int | None = None,
             concurrency: int | None = None, time_scale: float = 1.0, cost: CostModel | None = None,
             max_output_tokens: int | None = None, seed: int = 0, policy_kwargs: dict | None = None,
             unbounded: bool = False, progress: Callable[[int], None] | None = None,
             peer_fetch: PeerFetch | None = None) -> dict:
    """Replay a trace through ``policy`` on ``num_workers`` simulated workers.

    Args:
        reqs: `bench.trace.TraceRequest` s, or a `Workload` from `prepare` (then
            ``block_tokens``, ``block_size`` and ``max_output_tokens`` are the workload's).
        policy: a registered routing policy's name, ``"pooled"`` (the shared-cache
            reference), or a `RoutingPolicy` instance (used as is; ``policy_kwargs`` is then
            ignored), for reference rules that are not routers, as in `bench.route_frontier`.
        capacity_tokens: KV capacity of each worker in tokens. Memory grows with the blocks
            actually cached, not with the capacity (`BlockPool` makes blocks on first use).
        num_blocks: KV capacity of each worker in cache blocks (instead of tokens).
        unbounded: room for every block of the trace on every worker (nothing is ever
            evicted; the infinite-cache hit rate); ``capacity_tokens`` and ``num_blocks``
            are then ignored.
        block_tokens: tokens one trace block stands for.
        block_size: None, one cache block per trace block; else kvmesh's block size in
            tokens (token mode, as the live cluster).
        concurrency: closed loop with this many clients (as ``kvmesh bench``); None = open
            loop at the trace's timestamps.
        time_scale: open loop: every gap between trace timestamps is multiplied by this
            (2 = half the arrival rate), as ``kvmesh bench --time-scale``.
        cost: the worker cost model (default: `CostModel()`).
        seed: seed of the policy's random choices.
        policy_kwargs: constructor arguments of the policy.
        progress: called with the number of requests finished so far, every 256 requests
            and at the end.
        peer_fetch: model kvmesh's peer tier (`PeerFetch`): a request sent away from the
            worker holding more of its prefix fetches the blocks it lacks from that worker
            when the transfer beats recomputing them. None (the default): every miss is
            recomputed, as with the field's routers alone.

    Returns:
        ``policy``, ``num_requests``, ``hit_rate_blocks``, ``hit_rate_tokens`` (hits in the
        chosen worker's own cache), ``peer_hit_rate_blocks``, ``peer_hit_rate_tokens`` and
        ``peer_fetches`` (what came from a peer instead; zero without ``peer_fetch``),
        ``ttft_ms`` {p50, p99}, ``imbalance``, ``prefill_tokens_saved`` (own and peer hits),
        ``prefill_tokens_computed``, ``worker_requests``, ``sim_seconds``.

    Raises:
        ValueError: no capacity given, or a bad count.
    """
    t0 = time.perf_counter()
    wl = reqs if isinstance(reqs, Workload) else prepare(reqs, block_tokens, block_size, max_output_tokens)
    if num_workers < 1 or (concurrency is not None and concurrency < 1) or not (
            time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"workers and concurrency must be >= 1 and time scale a finite number > 0 "
                         f"(got {num_workers}, {concurrency}, {time_scale})")
    block = wl.cache_block_tokens
    if unbounded:
        num_blocks = sum(spec.alloc_blocks for spec in wl.specs) + 1
    elif num_blocks is None:
        if capacity_tokens is None:
            raise ValueError("give capacity_tokens or num_blocks")
        num_blocks = int(capacity_tokens // block)
    num_blocks = int(num_blocks)
    if num_blocks < 1:
        raise ValueError(f"capacity of {num_blocks} cache blocks per worker: give at least one block of {block} tokens")
    cost = cost or CostModel()
    cluster = (_Routed if isinstance(policy, RoutingPolicy) else _LAYOUTS.get(policy, _Routed))(
        policy, num_workers, num_blocks, wl.block_size or 1, policy_kwargs)
    rng = random.Random(seed)
    events: list = []
    order = 0
    pending: deque = deque()
    if concurrency is None:
        first = min((spec.arrival_s for spec in wl.specs), default=0.0)
        for spec in wl.specs:
            arrival = (spec.arrival_s - first) * time_scale
            heapq.heappush(events, (arrival, order, _ARRIVE, _Job(spec, arrival)))
            order += 1
    else:
        pending = deque(wl.specs)
        for _ in range(min(concurrency, len(pending))):
            heapq.heappush(events, (0.0, order, _ARRIVE, _Job(pending.popleft(), 0.0)))
            order += 1
    ttfts: list[float] = []
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    peer_blocks = peer_tokens = fetches = 0
    finished = 0

    def plan_fetch(job: _Job, w: _Worker, holder: _Worker, now: float) -> float:
        """Stage the blocks ``holder`` has beyond ``w``'s own hit (the worker's ``auto``
        rule, see `PeerFetch`); returns when the request joins ``w``'s queue."""
        spec = job.spec
        cap = spec.route_hashes[:spec.reuse_cap]
        local = len(w.cache.index.match(cap, spec.chain.block_tokens).values)
        have = len(holder.cache.index.match(cap, spec.chain.block_tokens).values)
        if have <= local:
            return now
        base = wl.hit_of(spec, local)[1]
        tokens = wl.hit_of(spec, have)[1] - base
        recompute = cost.prefill_s_per_token * tokens
        transfer = peer_fetch.seconds_for(tokens)
        if transfer >= recompute:
            return now
        deadline = min(recompute, peer_fetch.max_fetch_s)
        end, took = have, transfer
        if transfer > deadline:  # cut off at the deadline with the blocks that arrived
            arrived = peer_fetch.tokens_within(deadline)
            end = local
            while end < have and wl.hit_of(spec, end + 1)[1] - base <= arrived:
                end += 1
            took = deadline
        if end > local:
            job.fetch_from, job.fetch_to = local, end
        return now + took

    def start(w: _Worker, now: float) -> None:
        nonlocal order
        computing = w.computing
        while w.free_streams and w.queue:
            job = w.queue.popleft()
            spec = job.spec
            chain = spec.chain
            held = list(w.cache.index.match(spec.route_hashes[:spec.reuse_cap], chain.block_tokens).values)
            if computing and len(held) < spec.reuse_cap:
                # in-flight prefix sharing: the next block is being computed by a running
                # prefill; wait for it (without a stream) instead of computing it again
                owner = computing.get(spec.route_hashes[len(held)])
                if owner is not None and owner[1] == len(held):
                    owner[0].waiters.append(job)
                    continue
            s = w.free_streams.popleft()
            w.stream_counts[s] += 1
            w.cache.lock(held)
            new = w.cache.allocate(spec.alloc_blocks - len(held))
            job.held = len(held)
            job.allocated = new is not None
            job.ids = held + new if new is not None else held
            # staged peer blocks extend the own hit if they still join it (and have room)
            if job.allocated and job.fetch_from <= job.held < job.fetch_to:
                job.peer = job.fetch_to - job.held
            _, cached = wl.hit_of(spec, job.held + job.peer)
            if computing is not None and job.allocated:
                hashes = spec.route_hashes
                for i in range(job.held, spec.commit_blocks):
                    computing[hashes[i]] = (job, i)
            heapq.heappush(events, (now + cost.prefill_s_per_token * (spec.num_tokens - cached), order,
                                    _PREFILL_DONE, (w, s, job)))
            order += 1

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            job = payload
            w, matched, holder = cluster.route(job.spec, now, block, rng)
            job.est_prefill = max(1, job.spec.num_tokens - matched * block)
            w.queued_prefill += job.est_prefill
            w.inflight += 1
            ready = now if peer_fetch is None or holder is None else plan_fetch(job, w, holder, now)
            if ready > now:
                heapq.heappush(events, (ready, order, _FETCHED, (w, job)))
                order += 1
            else:
                w.queue.append(job)
                start(w, now)
        elif kind == _FETCHED:
            w, job = payload
            w.queue.append(job)
            start(w, now)
        elif kind == _PREFILL_DONE:
            w, s, job = payload
            spec = job.spec
            if job.allocated:
                w.cache.commit(spec.chain, job.ids, job.held, spec.commit_blocks)
                if w.computing is not None:
                    computing, hashes = w.computing, spec.route_hashes
                    for i in range(job.held, spec.commit_blocks):
                        if computing.get(hashes[i], (None,))[0] is job:
                            del computing[hashes[i]]
            if job.waiters:  # back to the head of the queue, in their order: their blocks are cached now
                w.queue.extendleft(reversed(job.waiters))
                job.waiters = []
            ttfts.append((now - job.arrival) * 1000.0)
            w.queued_prefill = max(0, w.queued_prefill - job.est_prefill)
            w.free_streams.append(s)
            heapq.heappush(events, (now + cost.decode_s_per_step * spec.output_tokens, order, _FINISH, (w, job)))
            order += 1
            start(w, now)
        else:
            w, job = payload
            spec = job.spec
            w.cache.unlock(job.ids)
            w.inflight -= 1
            hit, cached = wl.hit_of(spec, job.held)
            hit_blocks += hit
            total_blocks += spec.trace_blocks
            hit_tokens += cached
            if job.peer:
                hit_p, cached_p = wl.hit_of(spec, job.held + job.peer)
                peer_blocks += hit_p - hit
                peer_tokens += cached_p - cached
                fetches += 1
            total_tokens += spec.num_tokens
            finished += 1
            if progress is not None and not finished % 256:
                progress(finished)
            if pending:
                heapq.heappush(events, (now, order, _ARRIVE, _Job(pending.popleft(), now)))
                order += 1
    if progress is not None:
        progress(finished)
    counts = cluster.counts()
    ttfts.sort()
    mean = sum(counts) / len(counts) if counts else 0.0
    return {
        "policy": policy.name if isinstance(policy, RoutingPolicy) else policy,
        "num_requests": len(wl.specs),
        "hit_rate_blocks": hit_blocks / max(1, total_blocks),
        "hit_rate_tokens": hit_tokens / max(1, total_tokens),
        "peer_hit_rate_blocks": peer_blocks / max(1, total_blocks),
        "peer_hit_rate_tokens": peer_tokens / max(1, total_tokens),
        "peer_fetches": fetches,
        "ttft_ms": {"p50": round(_percentile(ttfts, 50), 3), "p99": round(_percentile(ttfts, 99), 3)},
        "imbalance": max(counts) / mean if mean else 0.0,
        "prefill_tokens_saved": hit_tokens + peer_tokens,
        "prefill_tokens_computed": total_tokens - hit_tokens - peer_tokens,
        "hit_blocks": hit_blocks,
        "total_blocks": total_blocks,
        "worker_requests": counts,
        "sim_seconds": round(time.perf_counter() - t0, 3),
    }


def simulate_live(reqs, policy: str, workers: int, num_blocks: int, tokens_per_block: int = 16,
                  block_size: int = 16, concurrency: int = 4, max_output_tokens: int | None = 4,
                  cost: CostModel | None = None, seed: int = 0, vocab_size: int = 256,
                  policy_kwargs: dict | None = None) -> dict:
    """The simulator with the knobs of the live demo (``kvmesh demo`` / ``kvmesh bench``).

    ``tokens_per_block`` tokens per trace block, kvmesh blocks of ``block_size`` tokens,
    ``num_blocks`` blocks per worker, a closed loop of ``concurrency`` clients and outputs
    capped at ``max_output_tokens``: token mode of `simulate` (same return value;
    ``hit_rate_blocks`` counts covered trace blocks as `bench.report` does).
    """
    wl = prepare(reqs, tokens_per_block, block_size, max_output_tokens, vocab_size)
    return simulate(wl, policy, workers, num_blocks=num_blocks, concurrency=concurrency, cost=cost, seed=seed,
                    policy_kwargs=policy_kwargs)


def run_policies(reqs, policies: Sequence[str] = DEFAULT_POLICIES, *, into: dict | None = None,
                 **kwargs) -> dict[str, dict]:
    """`simulate` each policy on the same prepared workload; ``{name: result}`` in order.

    ``kwargs`` go to `simulate` (``block_tokens``, ``block_size`` and
    ``max_output_tokens`` to `prepare`), except ``progress``: ``progress(policy)`` returns
    the per-request callback of that policy's run. Each result is also put in ``into`` as it
    finishes (so a caller interrupted part-way keeps the finished ones). Raises ValueError
    for an unknown name.
    """
    unknown = [p for p in policies if p not in POLICIES and p not in _LAYOUTS]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(sorted([*POLICIES, *_LAYOUTS]))}")
    prep = {k: kwargs.pop(k) for k in ("block_tokens", "block_size", "max_output_tokens") if k in kwargs}
    wl = reqs if isinstance(reqs, Workload) else prepare(reqs, **prep)
    progress = kwargs.pop("progress", None)
    out = into if into is not None else {}
    for p in policies:
        out[p] = simulate(wl, p, progress=progress(p) if progress is not None else None, **kwargs)
    return out


# ------------------------------------------------------------------------------ report
_FIELDS = ("hit_rate_blocks", "hit_rate_tokens", "peer_hit_rate_blocks", "ttft_ms", "imbalance", "prefill_tokens_saved")


def summary(results: dict[str, dict]) -> dict[str, dict]:
    """``{policy: {hit_rate_blocks, hit_rate_tokens, ttft_ms, imbalance, prefill_tokens_saved}}``."""
    return {name: {k: r[k] for k in _FIELDS} for name, r in results.items()}


def results_markdown(results: dict[str, dict], title: str = "", settings: dict | None = None,
                     command: str = "") -> str:
    """A Markdown table of `run_policies` results (with the fraction of ``pooled`` when present)."""
    pooled = results.get(POOLED, {}).get("hit_rate_blocks")
    lines = []
    if title:
        lines += [f"# {title}", ""]
    if command:
        lines += [f"Generated by `{command}`.", ""]
    if settings:
        lines += [f"- {k}: {v}" for k, v in settings.items()] + [""]
    peer = any(r.get("peer_fetches") for r in results.values())  # a column only when the peer tier ran
    head = "| policy | hit rate (blocks) | of pooled | hit rate (tokens) | " + \
           ("from a peer (blocks) | " if peer else "") + \
           "TTFT p50 (ms) | TTFT p99 (ms) | imbalance | prefill tokens saved | sim time (s) |"
    lines += [head, "|---|---:|---:|---:|" + ("---:|" if peer else "") + "---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        frac = f"{r['hit_rate_blocks'] / pooled:.1%}" if pooled else "—"
        peer_cell = f"{r.get('peer_hit_rate_blocks', 0.0):.2%} | " if peer else ""
        lines.append(f"| {name} | {r['hit_rate_blocks']:.2%} | {frac} | {r['hit_rate_tokens']:.2%} | {peer_cell}"
                     f"{r['ttft_ms']['p50']:,.0f} | {r['ttft_ms']['p99']:,.0f} | {r['imbalance']:.3f} | "
                     f"{r['prefill_tokens_saved']:,} | {r['sim_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def _command(args: argparse.Namespace) -> str:
    """The ``kvmesh sim`` command line that reproduces ``args`` (options left at default omitted)."""
    defaults = vars(_parser().parse_args([]))
    parts = ["kvmesh", "sim"]
    for key, value in vars(args).items():
        if key in defaults and (value != defaults[key] or key in ("trace", "workers")) and key not in ("out", "json", "no_progress"):
            flag = "--" + key.replace("_", "-")
            if key == "trace" and value == str(DEFAULT_TRACE):
                value = "bench/data/" + DEFAULT_TRACE.name  # the bundled trace, from the repository root
            parts += [flag] if value is True else [flag, shlex.quote(str(value))]
    if args.out:
        parts += ["--out", shlex.quote(str(args.out))]
    return " ".join(parts)


class _SimProgress:
    """A rich progress bar on stderr over every policy's replay: requests done, elapsed, ETA."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled
        self.total = total
        self._bar = None
        self._task = None
        self._base = 0      # requests of the policies already finished
        self._last = 0

    def __enter__(self) -> "_SimProgress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("sim", total=self.total)
        return self

    def policy(self, name: str) -> Callable[[int], None] | None:
        """The callback of one policy's replay (`simulate`'s ``progress``)."""
        if self._bar is None:
            return None
        self._base += self._last
        self._last = 0
        self._bar.update(self._task, description=f"sim {name}", completed=self._base)

        def update(done: int) -> None:
            self._last = done
            self._bar.update(self._task, completed=self._base + done)
        return update

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


# --------------------------------------------------------------------------------- CLI
def add_peer_fetch_args(p: argparse.ArgumentParser) -> None:
    """``--peer-fetch-gbps`` and ``--kv-bytes-per-token`` (see `peer_fetch_from_args`)."""
    p.add_argument("--peer-fetch-gbps", type=positive_float("--peer-fetch-gbps"), default=None,
                   help="model kvmesh's peer tier: a request sent away from the worker holding more of its "
                        "prefix fetches it from there at this many gigabits per second when that beats "
                        "recomputing it (default: off, every miss is recomputed)")
    p.add_argument("--kv-bytes-per-token", type=positive_int("--kv-bytes-per-token"),
                   default=PeerFetch.kv_bytes_per_token,
                   help=f"with --peer-fetch-gbps: KV bytes per token (default {PeerFetch.kv_bytes_per_token:,}, "
                        "an 8B Llama-3-shaped model in bf16)")


def peer_fetch_from_args(args: argparse.Namespace) -> PeerFetch | None:
    """The `PeerFetch` the flags of `add_peer_fetch_args` ask for, or None (off)."""
    if args.peer_fetch_gbps is None:
        if args.kv_bytes_per_token != PeerFetch.kv_bytes_per_token:
            raise ValueError("--kv-bytes-per-token sizes peer fetches: it needs --peer-fetch-gbps")
        return None
    return PeerFetch(bytes_per_s=args.peer_fetch_gbps * 1e9 / 8, kv_bytes_per_token=args.kv_bytes_per_token)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=str(DEFAULT_TRACE),
                   help="Mooncake-format JSONL, optionally .gz (default: the bundled full conversation trace)")
    p.add_argument("--workers", type=positive_int("--workers"), default=10, help="simulated workers (default 10)")
    p.add_argument("--capacity-tokens", type=positive_int("--capacity-tokens"), default=None,
                   help="KV capacity of each worker in tokens (memory grows with what is cached, not with this)")
    p.add_argument("--num-blocks", type=positive_int("--num-blocks"), default=None, help="KV capacity of each worker in cache blocks")
    p.add_argument("--unbounded", action="store_true",
                   help="room for every block on every worker: nothing is evicted (the infinite-cache hit rate); "
                        "instead of --capacity-tokens / --num-blocks")
    p.add_argument("--block-tokens", type=positive_int("--block-tokens"), default=TRACE_BLOCK_TOKENS,
                   help="tokens one trace block stands for (default 512, the trace's own)")
    p.add_argument("--block-size", type=positive_int("--block-size"), default=None,
                   help="kvmesh block size: synthesize and hash prompts as the live cluster does "
                        "(default: one cache block per trace block)")
    p.add_argument("--backend", choices=("kvmesh", "vllm"), default="kvmesh",
                   help="vllm: simulated vLLM servers behind `kvmesh router --backend vllm` (blocks named by "
                        "vLLM's published hashes; needs --block-size; see bench/vllm_sim.py)")
    p.add_argument("--vllm-hash-algo", default="sha256", help="with --backend vllm: the servers' "
                   "--prefix-caching-hash-algo")
    p.add_argument("--vllm-hash-seed", default=None, help="with --backend vllm: the servers' PYTHONHASHSEED")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated, '{POOLED}' = one shared cache of all workers' capacity (default: all)")
    p.add_argument("--concurrency", type=positive_int("--concurrency"), default=None,
                   help="closed loop with this many clients (default: open loop at the trace's timestamps)")
    p.add_argument("--time-scale", type=positive_float("--time-scale"), default=1.0,
                   help="open loop: multiply every gap between trace timestamps by this (2 = half the arrival "
                        "rate, 0.5 = twice), as in 'kvmesh bench' (default 1)")
    p.add_argument("--max-output-tokens", type=positive_int("--max-output-tokens"), default=None,
                   help="cap on each request's output tokens (default: the trace's output lengths)")
    p.add_argument("--max-requests", type=positive_int("--max-requests"), default=None, help="simulate the first N requests (default: all)")
    p.add_argument("--prefill-s-per-token", type=positive_float("--prefill-s-per-token"), default=CostModel.prefill_s_per_token,
                   help=f"cost model: seconds per computed prefill token (default {CostModel.prefill_s_per_token:.3g})")
    p.add_argument("--decode-s-per-step", type=positive_float("--decode-s-per-step"), default=CostModel.decode_s_per_step,
                   help=f"cost model: seconds per decode step (default {CostModel.decode_s_per_step:g})")
    add_peer_fetch_args(p)
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model on this machine's engine (built-in model) first")
    p.add_argument("--seed", type=int, default=0, help="seed of the policies' random choices (default 0)")
    p.add_argument("--out", default=None, help="also write OUT.json and OUT.md (OUT: a path prefix, not a folder)")
    p.add_argument("--title", default="", help="title of OUT.md (default: none)")
    p.add_argument("--json", action="store_true", help="print {policy: fields} as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _capacity_problem(args: argparse.Namespace) -> str | None:
    """Exactly one of --capacity-tokens, --num-blocks and --unbounded, or what is wrong."""
    given = [flag for flag, on in (("--capacity-tokens", args.capacity_tokens is not None),
                                   ("--num-blocks", args.num_blocks is not None),
                                   ("--unbounded", args.unbounded)) if on]
    if not given:
        return "give --capacity-tokens, --num-blocks or --unbounded (the KV capacity of each worker)"
    if len(given) > 1:
        return f"{' and '.join(given)} exclude each other; give one of them"
    block = args.block_size or args.block_tokens
    if args.capacity_tokens is not None and args.capacity_tokens < block:
        return (f"--capacity-tokens {args.capacity_tokens} holds no cache block of {block} tokens (the "
                f"{'--block-size' if args.block_size else '--block-tokens'}); give at least {block}")
    return None


def _out_paths(out: str) -> tuple[Path, Path]:
    """``--out PREFIX``'s two files: PREFIX.json and PREFIX.md. The prefix is kept whole (a
    prefix such as ``run_ts0.5x`` keeps its dot); a PREFIX ending in .json or .md is taken
    without it."""
    for ext in (".json", ".md"):
        if out.endswith(ext):
            out = out[:-len(ext)]
    return Path(out + ".json"), Path(out + ".md")


def cmd_sim(args: argparse.Namespace) -> int:
    from kvmesh.bench.cli_args import output_file_problem
    from kvmesh.bench.trace import load_mooncake

    problem = None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        problem = (f"--policies {args.policies!r} names no policy; give comma-separated names, e.g. "
                   f"{','.join(DEFAULT_POLICIES[:3])}")
    unknown = [name for name in policies if name not in POLICIES and name not in _LAYOUTS]
    if not problem and unknown:
        problem = (f"--policies: unknown policy {', '.join(map(repr, unknown))}; known: "
                   f"{', '.join(sorted([*POLICIES, *_LAYOUTS]))}")
    problem = problem or _capacity_problem(args)
    if not problem and args.out:  # checked before the replay (temporary files, removed), not after it
        if Path(args.out).is_dir():
            problem = (f"--out {args.out} is a folder; give a path prefix (such as {Path(args.out) / 'sim'}): "
                       f"the results go to PREFIX.json and PREFIX.md")
        else:
            out_json, out_md = _out_paths(args.out)
            problem = output_file_problem(out_json, "--out", make_parents=True) or \
                output_file_problem(out_md, "--out", make_parents=True)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        reqs = load_mooncake(args.trace, args.max_requests)
    except (OSError, ValueError) as exc:
        print(f"error: --trace {args.trace}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    if not reqs:
        print(f"error: --trace {args.trace} holds no requests (an empty file, or only blank lines); give a "
              "Mooncake-format JSON Lines trace with at least one request", file=sys.stderr)
        return 2
    cost = calibrate() if args.calibrate else CostModel(args.prefill_s_per_token, args.decode_s_per_step)
    work = reqs
    if args.backend == "vllm":  # blocks named by vLLM's published keys (bench.vllm_sim)
        from kvmesh.bench.vllm_sim import prepare_vllm
        from kvmesh.services.vllm_compat import VllmHashConfig

        if args.block_size is None:
            print("error: --backend vllm needs --block-size (the vLLM servers' --block-size)", file=sys.stderr)
            return 2
        try:
            work = prepare_vllm(reqs, VllmHashConfig(block_size=args.block_size, hash_algo=args.vllm_hash_algo,
                                                     hash_seed=args.vllm_hash_seed),
                                args.block_tokens, args.max_output_tokens)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        peer_fetch = peer_fetch_from_args(args)  # a usage error before the progress bar
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    stopped = None  # the signal that stopped the replay part-way: the finished policies are still written
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread (called in-process): no handler of ours
        previous = None
    try:
        with _SimProgress(not args.no_progress, len(policies) * len(reqs)) as bar:
            run_policies(work, policies, into=results, num_workers=args.workers, capacity_tokens=args.capacity_tokens,
                         num_blocks=args.num_blocks, block_tokens=args.block_tokens,
                         block_size=args.block_size, concurrency=args.concurrency,
                         time_scale=args.time_scale, cost=cost, max_output_tokens=args.max_output_tokens,
                         seed=args.seed, unbounded=args.unbounded, progress=bar.policy,
                         peer_fetch=peer_fetch)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        stopped = str(exc) or "SIGINT"
        print(f"\n{stopped}: stopped; {len(results)} of {len(policies)} policies finished"
              + (f" ({', '.join(results)}), written below" if results else ""), file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    settings = {
        "trace": Path(args.trace).name, "requests": len(reqs), "workers": args.workers,
        "capacity_tokens": "unbounded" if args.unbounded else args.capacity_tokens,
        "num_blocks": args.num_blocks, "block_tokens": args.block_tokens,
        "block_size": args.block_size if args.block_size is not None else
                      f"one cache block per trace block ({args.block_tokens} tokens)",
        "backend": args.backend,
        "arrivals": f"closed loop of {args.concurrency}" if args.concurrency else
                    f"open loop, gaps between trace timestamps x {args.time_scale:g}",
        "max_output_tokens": args.max_output_tokens if args.max_output_tokens is not None else "the trace's",
        "cost_model": asdict(cost), "seed": args.seed,
    }
    if args.peer_fetch_gbps is not None:
        settings["peer_fetch"] = asdict(peer_fetch_from_args(args))
    if args.out:
        out_json, out_md = _out_paths(args.out)
        command = _command(args)
        try:
            out_json.parent.mkdir(parents=True, exist_ok=True)
            saved = {"command": command, "settings": settings, "results": results}
            if stopped:
                saved.update(partial=True, stopped_by=stopped)
            out_json.write_text(json.dumps(saved, indent=2) + "\n")
            out_md.write_text(results_markdown(results, title=args.title, settings=settings, command=command))
        except OSError as exc:
            print(f"error: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(summary(results), indent=2))
    else:
        print(results_markdown(results, title=args.title, settings=settings), end="")
    return 0 if stopped is None else 143 if stopped == "SIGTERM" else 130


def _raise_interrupt(signum, frame) -> None:
    """SIGTERM stops a replay as Ctrl-C does: the policies that finished are still written."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def register(sub) -> None:
    """Add ``kvmesh sim`` to the CLI's sub-parsers."""
    p = sub.add_parser("sim", help="replay a Mooncake trace through the routing policies on simulated workers "
                       "(no model): hit rate, TTFT, imbalance per policy")
    _add_args(p)
    p.set_defaults(func=cmd_sim)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    _add_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return cmd_sim(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
