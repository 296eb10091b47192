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
    """

    num_tokens: int
    block_hashes: list[bytes]
    block_size: int


class RoutingPolicy(ABC):
    """Chooses one worker per request. Subclasses set ``name`` and register."""

    name: ClassVar[str]

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

    Raises:
        ValueError: ``window`` < 1.
    """

    __slots__ = ("window", "_decay", "_scale", "_counts")

    def __init__(self, window: float = 400.0):
        if window < 1:
            raise ValueError(f"window must be >= 1 decision, got {window}")
        self.window = float(window)
        self._decay = 1.0 - 1.0 / self.window
        self._scale = 1.0          # counts are stored divided by the accumulated decay
        self._counts: dict[str, float] = {}

    def note(self, worker_id: str) -> None:
        """Record one request routed to ``worker_id``."""
        self._scale *= self._decay
        if self._scale < 1e-200:  # renormalise before underflow
            self._counts = {k: v * self._scale for k, v in self._counts.items()}
            self._scale = 1.0
        self._counts[worker_id] = self._counts.get(worker_id, 0.0) + 1.0 / self._scale

    def value(self, worker_id: str) -> float:
        """Decayed count of requests routed to ``worker_id`` (requests)."""
        return self._counts.get(worker_id, 0.0) * self._scale

    def forget(self, worker_id: str) -> None:
        self._counts.pop(worker_id, None)


@register
class KVAwarePolicy(RoutingPolicy):
    """Lowest estimated prefill cost among workers within their share cap. The default.

    For worker ``i`` and a request of ``N`` tokens in blocks of ``B`` tokens::

        cost_i = (N - B * weighted_i)                      # prefill left to compute there
                 + queue_weight * queued_prefill_tokens_i  # prefill work ahead of it
                 + decode_weight * running_requests_i      # decode steps sharing its steps
        eligible_i: routed_i <= (1 + share_cap) * mean(routed) + share_slack

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

    Raises:
        ValueError: a negative parameter.
    """

    name = "kv_aware"

    def __init__(self, queue_weight: float = 0.05, decode_weight: float = 128.0, share_cap: float = 0.15,
                 share_slack: float = 4.0):
        if min(queue_weight, decode_weight, share_cap, share_slack) < 0:
            raise ValueError("queue_weight, decode_weight, share_cap and share_slack must be >= 0")
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
        mean = sum(w.routed_recent for w in workers) / len(workers)
        limit = (1.0 + self.share_cap) * mean + self.share_slack
        capped = [w.routed_recent > limit for w in workers]
        if all(capped):
            capped = [False] * len(workers)
        out = []
        for w, over in zip(workers, capped):
            if over:
                out.append(math.inf)
                continue
            out.append(n_tok - req.block_size * w.weighted_blocks
                       + self.queue_weight * w.queued_prefill_tokens
                       + self.decode_weight * w.running_requests)
        return out

    def choose(self, req, workers, rng):
        costs = self.costs(req, workers)
        # Round away float noise so equal estimates tie and the tie-break is random.
        return _argmin(workers, [round(c, 6) for c in costs], rng)


# Other routers' policies (sglang_cache_aware, ray_prefix_affinity, dynamo_kv, llmd_precise,
# power_of_two) register themselves on import.
from kvmesh.services import field_policies as _field_policies  # noqa: E402,F401
