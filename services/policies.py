"""Routing policies: pick the worker for one request from a list of views.

Policies are plain objects without I/O. The router builds one
:class:`WorkerView` per live worker (prefix match from
:class:`services.cluster_index.ClusterIndex`, load from the worker's lease and
its own bookkeeping) and asks the policy to choose. Policies register by name
(:func:`register`) and are built with :func:`make_policy`; randomness comes
only from the ``rng`` the caller passes, so a seeded ``random.Random`` makes a
run reproducible.
"""
from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

__all__ = [
    "WorkerView",
    "RouteRequest",
    "RoutingPolicy",
    "POLICIES",
    "DEFAULT_POLICY",
    "register",
    "make_policy",
    "RoundRobinPolicy",
    "RandomPolicy",
    "LeastLoadedPolicy",
    "PrefixPolicy",
    "KVAwarePolicy",
    "RoutedShare",
]


@dataclass(slots=True)
class WorkerView:
    """What a policy knows about one worker for one request.

    Attributes:
        worker_id: worker id.
        address: its gRPC address (host:port).
        matched_blocks: leading blocks of the request this worker holds (blocks).
        weighted_blocks: the same, credited by tier with ``TIER_WEIGHTS`` (blocks).
        running_requests: requests decoding there (requests).
        waiting_requests: requests queued there (requests).
        queued_prefill_tokens: prefill tokens not yet computed there, including
            requests this router just sent (tokens).
        free_blocks: free KV blocks there (blocks).
        total_blocks: KV pool size there (blocks).
        routed_recent: requests this router sent there recently, decayed per
            routing decision (`RoutedShare.value`, requests).
    """

    worker_id: str
    address: str
    matched_blocks: int = 0
    weighted_blocks: float = 0.0
    running_requests: int = 0
    waiting_requests: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    routed_recent: float = 0.0


@dataclass(slots=True)
class RouteRequest:
    """The request being routed.

    Attributes:
        num_tokens: prompt length (tokens).
        block_hashes: chained hashes of the prompt's full blocks.
        block_size: tokens per block.
        routed_mean: mean `WorkerView.routed_recent` over every live worker (requests), for
            callers that pass a shortlist of views; None: the mean over the views given.
    """

    num_tokens: int
    block_hashes: list[bytes]
    block_size: int
    routed_mean: float | None = None


class RoutingPolicy(ABC):
    """Chooses one worker per request. Subclasses set ``name`` and register."""

    name: ClassVar[str]
    #: True when the policy decides as well from a shortlist of views (``services.shortlist``:
    #: deepest prefix holders, least-routed and random workers, with
    #: `RouteRequest.routed_mean` set) as from every worker; callers with large fleets may
    #: then build views for the shortlist only.
    uses_shortlist: ClassVar[bool] = False

    @abstractmethod
    def choose(self, req: RouteRequest, workers: list[WorkerView], rng: random.Random) -> WorkerView:
        """The worker to send ``req`` to.

        Raises:
            ValueError: ``workers`` is empty.
        """


#: Registered policies by name.
POLICIES: dict[str, type[RoutingPolicy]] = {}
#: Name of the policy a router uses unless told otherwise.
DEFAULT_POLICY = "kv_aware"


def register(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
    """Class decorator: make ``cls`` available to :func:`make_policy` under ``cls.name``.

    Raises:
        ValueError: ``cls.name`` is missing or already taken by another class.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} has no policy name")
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"policy name {name!r} already registered by {POLICIES[name].__name__}")
    POLICIES[name] = cls
    return cls


def make_policy(name: str = DEFAULT_POLICY, **kwargs) -> RoutingPolicy:
    """A new policy instance by registered name; ``kwargs`` go to its constructor.

    Raises:
        ValueError: no policy has that name (the message lists the known ones).
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return cls(**kwargs)


def _require(workers: Sequence[WorkerView]) -> None:
    if not workers:
        raise ValueError("no workers to choose from")


def _argmin(workers: Sequence[WorkerView], keys: Sequence, rng: random.Random) -> WorkerView:
    """A worker with the smallest key, ties broken uniformly at random."""
    best = min(keys)
    tied = [w for w, k in zip(workers, keys) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@register
class RoundRobinPolicy(RoutingPolicy):
    """Cycle through workers in worker-id order, ignoring cache and load.

    Keeps the last worker id chosen, so workers joining or leaving do not
    reset the rotation: the next choice is the first id after the last one.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, req, workers, rng):
        _require(workers)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[0]
        if self._last is not None:
            for w in ordered:
                if w.worker_id > self._last:
                    pick = w
                    break
        self._last = pick.worker_id
        return pick


@register
class RandomPolicy(RoutingPolicy):
    """Uniformly random worker."""

    name = "random"

    def choose(self, req, workers, rng):
        _require(workers)
        return rng.choice(workers)


@register
class LeastLoadedPolicy(RoutingPolicy):
    """Fewest queued prefill tokens, then fewest running requests; ties at random."""

    name = "least_loaded"

    def choose(self, req, workers, rng):
        _require(workers)
        return _argmin(workers, [(w.queued_prefill_tokens, w.running_requests) for w in workers], rng)


@register
class PrefixPolicy(RoutingPolicy):
    """Longest prefix match (``matched_blocks``) only; ties at random. Ignores load."""

    name = "prefix"

    def choose(self, req, workers, rng):
        _require(workers)
        return _argmin(workers, [-w.matched_blocks for w in workers], rng)


class RoutedShare:
    """Requests routed to each worker, exponentially decayed per routing decision.

    Every `note` first multiplies all counts by ``1 - 1/window`` and then adds one to
    the chosen worker, so a count is the worker's share of roughly the last ``window``
    decisions (requests), however fast or slow they arrive. Pure and deterministic; the
    router and the simulator each keep one and pass ``value`` as
    `WorkerView.routed_recent`.

    The window grows with the fleet: after `set_fleet` (n workers) it is
    ``max(window, per_worker * n)`` decisions, so the mean count per worker stays near
    ``per_worker`` at any fleet size. With a fixed window of 400 decisions, 1,000 workers
    average 0.4 requests each, and a share cap with a slack of a few requests no longer
    bounds anything (`KVAwarePolicy`).

    Also keeps the decayed total (`total`) and, for shortlists, the workers with the
    smallest counts (`least`), both without touching every worker.

    Raises:
        ValueError: ``window`` < 1 or ``per_worker`` < 0.
    """

    __slots__ = ("window", "base_window", "per_worker", "fleet", "_decay", "_scale", "_counts", "_total",
                 "_heap", "_tick")

    def __init__(self, window: float = 400.0, per_worker: float = 40.0):
        if window < 1:
            raise ValueError(f"window must be >= 1 decision, got {window}")
        if per_worker < 0:
            raise ValueError(f"per_worker must be >= 0 decisions, got {per_worker}")
        self.base_window = float(window)
        self.per_worker = float(per_worker)
        self.fleet = 0
        self.window = self.base_window
        self._decay = 1.0 - 1.0 / self.window
        self._scale = 1.0          # counts are stored divided by the accumulated decay
        self._counts: dict[str, float] = {}
        self._total = 0.0          # sum of stored counts
        self._heap: list[tuple[float, int, str]] = []   # (stored count, tick, worker) with stale entries
        self._tick = 0

    def set_fleet(self, num_workers: int) -> None:
        """Tell the number of live workers (workers); the window becomes
        ``max(window, per_worker * num_workers)`` decisions."""
        n = max(0, int(num_workers))
        if n == self.fleet:
            return
        self.fleet = n
        self.window = max(self.base_window, self.per_worker * n)
        self._decay = 1.0 - 1.0 / self.window

    def note(self, worker_id: str) -> None:
        """Record one request routed to ``worker_id``."""
        self._scale *= self._decay
        if self._scale < 1e-200:  # renormalise before underflow
            s = self._scale
            self._counts = {k: v * s for k, v in self._counts.items()}
            self._total *= s
            self._heap = [(c, t, w) for t, (w, c) in enumerate(self._counts.items())]
            heapq.heapify(self._heap)
            self._tick = len(self._heap)
            self._scale = 1.0
        add = 1.0 / self._scale
        c = self._counts.get(worker_id, 0.0) + add
        self._counts[worker_id] = c
        self._total += add
        self._push(c, worker_id)

    def _push(self, stored: float, worker_id: str) -> None:
        self._tick += 1
        heapq.heappush(self._heap, (stored, self._tick, worker_id))
        if len(self._heap) > 4 * len(self._counts) + 64:  # drop stale entries
            self._heap = [(c, t, w) for t, (w, c) in enumerate(self._counts.items())]
            heapq.heapify(self._heap)

    def track(self, worker_id: str) -> None:
        """Count ``worker_id`` (at 0 if new) among the candidates of `least`."""
        if worker_id not in self._counts:
            self._counts[worker_id] = 0.0
            self._push(0.0, worker_id)

    def value(self, worker_id: str) -> float:
        """Decayed count of requests routed to ``worker_id`` (requests)."""
        return self._counts.get(worker_id, 0.0) * self._scale

    def total(self) -> float:
        """Sum of all workers' decayed counts (requests); O(1)."""
        return self._total * self._scale

    def least(self, k: int) -> list[str]:
        """Up to ``k`` tracked or noted workers with the smallest counts, smallest first.

        Cost O((k + stale entries popped) * log n), not O(n).
        """
        heap = self._heap
        counts = self._counts
        out: list[str] = []
        keep: list[tuple[float, int, str]] = []
        seen: set[str] = set()
        while heap and len(out) < k:
            entry = heapq.heappop(heap)
            c, _, w = entry
            if w in seen or counts.get(w) != c:
                continue  # stale: the worker was noted again or forgotten since
            seen.add(w)
            out.append(w)
            keep.append(entry)
        for entry in keep:
            heapq.heappush(heap, entry)
        return out

    def forget(self, worker_id: str) -> None:
        c = self._counts.pop(worker_id, None)
        if c is not None:
            self._total -= c


@register
class KVAwarePolicy(RoutingPolicy):
    """Lowest estimated prefill cost among workers within their share cap. The default.

    For worker ``i`` and a request of ``N`` tokens in blocks of ``B`` tokens::

        cost_i = (N - B * weighted_i)                      # prefill left to compute there
                 + queue_weight * queued_prefill_tokens_i  # prefill work ahead of it
                 + decode_weight * running_requests_i      # decode steps sharing its steps
                 + share_weight * N * (routed_i - mean(routed)) / max(mean(routed), 1)
        eligible_i: routed_i <= (1 + share_cap) * mean(routed) + share_slack
                    or (i is idle and B * matched_i >= idle_exempt_hit * N)

    The cheapest eligible worker wins, ties at random (when none is eligible, all are).

    * ``weighted_i`` credits each cached leading block by its tier
      (``services.cluster_index.TIER_WEIGHTS``): a device hit saves a whole block of
      prefill, a disk hit less. Blocks every worker holds (a system prompt all requests
      share) lower every cost alike and so give no preference.
    * ``queue_weight = 0.05``: a cached prefix is worth more than the wait it saves once.
      A turn sent away from its holder recomputes the whole prefix and leaves a second copy
      that crowds both caches, so the holder keeps a request until its queue exceeds
      another worker's by twenty times the prefill the hit saves. On the full Mooncake conversation trace (10
      workers x 3M tokens, `bench.sim`) 0.5 kept 94 % of the pooled hit rate, 0.05 keeps
      99 %; at 0.03 conversations pile up on their holders (imbalance 1.12 at 16 workers).
    * ``decode_weight = 128`` tokens per running request: requests in flight, which share
      the worker's decode steps, are also where a worker's conversations live, so new
      conversations go where fewer are in flight. At 16 tokens the same trace at 16
      workers reached an imbalance of 1.14; at 128 it stays under 1.09.
    * The share cap bounds imbalance directly: ``routed_i`` is the worker's decayed count of
      this router's recent requests (`RoutedShare`, a window of about 400 decisions); a
      worker more than ``share_cap = 15 %`` plus ``share_slack = 4`` requests above the
      mean takes nothing until the others catch up. Without it, sticky conversations and
      a prefix that every request shares (Mooncake's conversation trace) pile onto
      whichever worker cached them first. The cap applies to idle workers too: exempting
      them let sequential traffic (one request at a time) follow the shared first block to
      a single worker. The price: at very low traffic a lone conversation moves to another
      worker after about ``share_slack`` turns, recomputing its prefix once.
    * The cap scales with the fleet: the caller's `RoutedShare` keeps a window of
      ``40 x workers`` decisions (`RoutedShare.set_fleet`), so the mean count stays near
      40 requests and ``share_slack`` means the same at 10 and 1,000 workers.
    * ``share_weight = 0.05``: each request of recent share above (below) the mean costs
      (saves) ``0.05 * N / mean`` tokens. It draws new conversations to workers that have
      had less: without it, workers that never served a request lack the prefix every
      request shares (Mooncake's first block) and are never the cheapest, so at 100
      workers a quarter of the fleet stayed empty while the rest sat at the cap and
      bounced conversations (14.5 % hit rate against pooled 36.6 %). Equal costs go to
      the worker with the smaller share.
    * ``idle_exempt_hit = 0.5``: a worker over the cap with nothing queued or running
      still takes a request whose cached prefix there covers at least half of the
      prompt; there is no queue to protect, and sending it away recomputes the prefix.
      In large fleets (1,000 workers, a dozen requests each over the trace's hour) a
      long conversation alone passes the cap; the exemption keeps it on its holder.

    The cost is an estimate of time-to-first-token in prefill-token units, in the spirit
    of NVIDIA Dynamo's KV router (overlap credited against prefill and decode load) and
    SGLang's cache-aware router (balance thresholds that override cache affinity); the
    share cap on a per-decision decayed count is this project's. Defaults were chosen with
    `bench.sim` on the bundled trace sample and the full conversation trace (see
    docs/ROUTING.md).

    Args:
        queue_weight: fraction of a worker's queued prefill tokens charged, >= 0.
        decode_weight: tokens charged per running request, >= 0.
        share_cap: allowed relative excess over the mean share, >= 0.
        share_slack: allowed absolute excess (requests), >= 0.
        share_weight: fraction of the prompt charged per mean share of excess, >= 0.
        idle_exempt_hit: fraction of the prompt an idle worker must hold to pass its cap, >= 0.

    Raises:
        ValueError: a negative parameter.
    """

    name = "kv_aware"
    uses_shortlist = True

    def __init__(self, queue_weight: float = 0.05, decode_weight: float = 128.0, share_cap: float = 0.15,
                 share_slack: float = 4.0, share_weight: float = 0.05, idle_exempt_hit: float = 0.5):
        if min(queue_weight, decode_weight, share_cap, share_slack, share_weight, idle_exempt_hit) < 0:
            raise ValueError("queue_weight, decode_weight, share_cap, share_slack and share_weight must be >= 0")
        self.share_weight = float(share_weight)
        self.idle_exempt_hit = float(idle_exempt_hit)
        self.queue_weight = float(queue_weight)
        self.decode_weight = float(decode_weight)
        self.share_cap = float(share_cap)
        self.share_slack = float(share_slack)

    def costs(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        """Estimated cost of ``req`` on each worker in prefill tokens (same order);
        ``math.inf`` for a worker over its share cap while another is under it.

        Raises:
            ValueError: ``workers`` is empty.
        """
        _require(workers)
        n_tok = float(req.num_tokens)
        mean = req.routed_mean if req.routed_mean is not None else \
            sum(w.routed_recent for w in workers) / len(workers)
        limit = (1.0 + self.share_cap) * mean + self.share_slack
        per_share = self.share_weight * n_tok / max(mean, 1.0)
        exempt = self.idle_exempt_hit * n_tok
        capped = [w.routed_recent > limit and not (
            w.running_requests == 0 and w.queued_prefill_tokens == 0 and req.block_size * w.matched_blocks >= exempt)
            for w in workers]
        if all(capped):
            capped = [False] * len(workers)
        out = []
        for w, over in zip(workers, capped):
            if over:
                out.append(math.inf)
                continue
            out.append(n_tok - req.block_size * w.weighted_blocks
                       + self.queue_weight * w.queued_prefill_tokens
                       + self.decode_weight * w.running_requests
                       + per_share * (w.routed_recent - mean))
        return out

    def choose(self, req, workers, rng):
        costs = self.costs(req, workers)
        # Round away float noise so equal estimates tie and the tie-break is random.
        # Equal estimates go to the worker with the smallest recent share, then at random.
        return _argmin(workers, [(round(c, 6), round(w.routed_recent, 6)) for c, w in zip(costs, workers)], rng)


# Other routers' policies (sglang_cache_aware, ray_prefix_affinity, dynamo_kv, llmd_precise,
# power_of_two) register themselves on import.
from kvmesh.services import field_policies as _field_policies  # noqa: E402,F401
