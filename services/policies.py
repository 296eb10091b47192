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
import statistics
from collections import OrderedDict
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
    "prefix_holder",
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
        common_blocks: leading blocks held by more than kv_aware's ``widely_held`` fraction
            of every live worker (`ClusterIndex.common_depth`), for callers that pass a
            shortlist of views; None: read off the views given.
        retry: the request was routed before (a retry after a worker failed it): policies
            that learn from the requests they route (kv_aware's mean prompt length) count
            it once.
        sender: who sent it (the caller's tenant; "" when unknown): kv_aware's mean prompt
            length is the median over recent senders, so one client cannot set it for all.
    """

    num_tokens: int
    block_hashes: list[bytes]
    block_size: int
    routed_mean: float | None = None
    common_blocks: int | None = None
    retry: bool = False
    sender: str = ""


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

    def __init__(self, window: float = 400.0, per_worker: float = 300.0):
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

    def keep_only(self, worker_ids) -> None:
        """Forget every counted worker not in ``worker_ids`` (a set or dict); O(counted)."""
        for w in [w for w in self._counts if w not in worker_ids]:
            self.forget(w)


@register
class KVAwarePolicy(RoutingPolicy):
    """Lowest predicted time-to-first-token, with recompute charged to the fleet, among
    workers within their share cap. The default.

    For worker ``i`` and a request of ``N`` tokens in blocks of ``B`` tokens, with
    ``u_i = N - B * weighted_i`` the prefill tokens it would compute there and ``r_i`` the
    part of them beyond the leading blocks that more than ``widely_held`` of the workers in
    view hold (``r_i = N - B * max(weighted_i, common)``)::

        cost_i = queued_prefill_tokens_i + u_i                  # predicted TTFT, in prefill tokens
                 + recompute_weight * r_i                        # what recomputing r_i costs everyone else
                 + decode_weight * running_requests_i
                 + share_weight * s_i * (routed_i - mean(routed)) / max(mean(routed), 1)
        s_i = min(u_i, share_tokens_cap * mean recent prompt length)
        eligible_i: routed_i <= (1 + share_cap) * mean(routed) + share_slack
                    or (i is idle and B * matched_i >= idle_exempt_hit * N)
                    or (routed_i <= (1 + hard_cap) * mean(routed)
                        and cost_i < min(cost_j, j within its cap) - escape_prompts * mean recent prompt)

    The cheapest eligible worker wins, ties at random (when none is eligible, all are).

    * The first two terms are the request's predicted TTFT on ``i`` in units of one
      prefill token: the prefill queued ahead of it plus its own uncached prefill (a
      worker prefills in arrival order; decode runs beside it).
    * ``recompute_weight = 12``: a token computed is charged 13 times, once for this
      request's wait and 12 times for what it costs after: it occupies the worker that
      later requests queue behind, and a prefix recomputed away from its holder leaves a
      second copy that crowds both caches and splits the prefix's later requests. So a
      holder keeps a request until its queue exceeds another worker's by 13 times the
      prefill the hit saves; between workers without a hit (new work) the queue decides
      at full weight. (Equivalently the queue is charged at 1/13 of a recomputed token.)
    * ``widely_held = 0.5``: blocks that more than half of the workers in view hold are
      charged their prefill time only. Copying a prefix most workers already have (a system
      prompt every request starts with, Mooncake's shared first block) splits nothing and
      crowds no cache that is not crowded already; without this a cold worker, which lacks
      it, costs 12 times the shared prompt more than every warm one and gets no new work
      until all warm workers reach the cap (a multi-turn workload with a 512-token system
      prompt on 100 workers: imbalance 1.29, 17 workers never chosen; with it 1.13, none).
    * ``decode_weight = 0`` tokens per running request: in the simulator's worker (and
      roughly in an engine with chunked prefill) decodes do not delay a prefill; the
      request-count balance the term used to buy is the share term's job.
    * The share cap bounds imbalance directly: ``routed_i`` is the worker's decayed count of
      this router's recent requests (`RoutedShare`, a window of ``300 x workers``
      decisions); a worker more than ``share_cap = 5 %`` plus ``share_slack = 4``
      requests above the mean takes nothing until the others catch up. Without it,
      sticky conversations and a prefix that every request shares (Mooncake's
      conversation trace) pile onto whichever worker cached them first. The window is
      long (300 requests per worker) so that the cap is about the long-run share (the
      imbalance of a whole run) and short-term load is the queue's business.
    * ``share_weight = 3``: each request of recent share above (below) the mean costs
      (saves) ``3 / mean`` of the request's *uncached* tokens. It places new work (all
      of it uncached) on workers with less share, and hardly moves a request with a
      large hit (little uncached). Without it, workers that never served a request lack
      the prefix every request shares and are never the cheapest (at 100 workers on the
      Mooncake trace a quarter of the fleet stayed empty).
    * ``share_tokens_cap = 1``: the share term counts at most the mean prompt length of
      this router's recent requests (`mean_prompt`: per sender an exponential average over
      ``prompt_window = 200`` of its requests, and the median over senders, so that one
      client's flood moves only its own), so it binds only on prompts longer than usual. Proportional to the
      whole uncached prompt, it pulled the largest new prompts to the workers with the
      fewest requests, which are often the ones behind a long queue of large prompts;
      they then kept few requests and stayed the pull's target while the others reached
      the cap and sent their holders' requests away to recompute there. On Mooncake's
      synthetic trace (prompts of 17 to 191,378 tokens) at 4 workers x 2M tokens this
      left 42.8 % of blocks hit against the field's 52.6 % (now 51.5 %; docs/ROUTING.md,
      "Mooncake's synthetic trace"). Where prompts are of one size it changes nothing.
    * ``idle_exempt_hit = 0.5``: a worker over the cap with nothing queued or running
      still takes a request whose cached prefix there covers at least half of the
      prompt; there is no queue to protect, and sending it away recomputes the prefix.
      In large fleets (1,000 workers, a dozen requests each over the trace's hour) a
      long conversation alone passes the cap; the exemption keeps it on its holder.
    * ``escape_prompts = 16``, ``hard_cap = 0.08``: a worker over the cap still takes a
      request that costs more than 16 mean prompts of prefill less there than on every
      worker within its cap, as long as its share is within 8 % of the mean (no slack:
      the balance target is 10 % over a whole run, and the decayed share runs ahead of
      it). Where prompt lengths vary widely, the workers that received the largest
      prompts have the fewest requests and the longest queues; with the others at the
      cap, the cap sent every request, a 20-token chat included, behind a queue of
      300,000 tokens while another's held 100,000. In overload that fed itself: Mooncake's
      synthetic trace at 4 workers x 3M tokens, arrivals 1.43 times the trace's, 42.7 % of
      blocks hit and TTFT p99 82 s without the escape, 54.2 % and 38.8 s with it (the
      field's routers: 59.7 %, 25.7 s). Where prompts are of similar length the margin is
      rarely reached (docs/ROUTING.md, "The cap's escape").
    * ``weighted_i`` credits each cached leading block by its tier
      (``services.cluster_index.TIER_WEIGHTS``): a device hit saves a whole block of
      prefill, a disk hit less. Blocks every worker holds lower every cost alike.

    Defaults were chosen with `bench.sim` and `bench.route_sweep` by the worst case over
    the sweep's tuning workloads at 10 workers and the Mooncake conversation trace at 10,
    100 and 1,000 workers, then checked on held-out workloads (docs/ROUTING.md).

    Args:
        recompute_weight: extra charge per computed prefill token, >= 0.
        decode_weight: tokens charged per running request, >= 0.
        share_cap: allowed relative excess over the mean share, >= 0.
        share_slack: allowed absolute excess (requests), >= 0.
        share_weight: fraction of the uncached tokens charged per mean share of excess, >= 0.
        idle_exempt_hit: fraction of the prompt an idle worker must hold to pass its cap, >= 0.
        widely_held: a leading block held by more than this fraction of the workers in view
            is charged its prefill time only, in [0, 1].
        share_tokens_cap: most tokens the share term counts, as a fraction of the mean
            recent prompt length, > 0; None counts every uncached token.
        prompt_window: decisions the mean prompt length averages over (the exponential
            average's weight of a new prompt is ``1 / prompt_window``), >= 1.
        escape_prompts: how much cheaper (in mean recent prompts of prefill) a worker over
            the cap must be than every worker within it to take a request anyway, >= 0;
            None: never.
        hard_cap: relative excess over the mean share past which no cost lets a worker
            take a request (no slack added; the idle exemption aside), finite, >= 0.

    Raises:
        ValueError: a negative parameter, ``widely_held`` outside [0, 1], a
            ``share_tokens_cap`` <= 0, a ``prompt_window`` < 1, an ``escape_prompts`` < 0 or a
            ``hard_cap`` that is not finite.
    """

    name = "kv_aware"
    uses_shortlist = True

    def __init__(self, recompute_weight: float = 12.0, decode_weight: float = 0.0, share_cap: float = 0.05,
                 share_slack: float = 4.0, share_weight: float = 3.0, idle_exempt_hit: float = 0.5,
                 widely_held: float = 0.5, share_tokens_cap: float | None = 1.0, prompt_window: float = 200.0,
                 escape_prompts: float | None = 16.0, hard_cap: float = 0.08):
        if min(recompute_weight, decode_weight, share_cap, share_slack, share_weight, idle_exempt_hit, hard_cap) < 0:
            raise ValueError("recompute_weight, decode_weight, share_cap, share_slack, share_weight, "
                             "idle_exempt_hit and hard_cap must be >= 0")
        if not math.isfinite(hard_cap):
            raise ValueError(f"hard_cap must be a finite number >= 0, got {hard_cap}")
        if escape_prompts is not None and not escape_prompts >= 0:
            raise ValueError(f"escape_prompts must be >= 0 (None, from Python: never), got {escape_prompts}")
        self.escape_prompts = None if escape_prompts is None else float(escape_prompts)
        self.hard_cap = float(hard_cap)
        if not 0.0 <= widely_held <= 1.0:
            raise ValueError(f"widely_held must be in [0, 1], got {widely_held}")
        if share_tokens_cap is not None and not share_tokens_cap > 0:
            raise ValueError(f"share_tokens_cap must be > 0 (None, from Python: no cap), got {share_tokens_cap}")
        if not 1 <= prompt_window < math.inf:
            raise ValueError(f"prompt_window must be finite and >= 1, got {prompt_window}")
        self.share_tokens_cap = None if share_tokens_cap is None else float(share_tokens_cap)
        self.prompt_window = float(prompt_window)
        #: the median over the last ``MAX_SENDERS`` senders of each one's exponential
        #: average of its prompt lengths (tokens); None before the first prompt
        self.mean_prompt: float | None = None
        self._by_sender: OrderedDict[str, float] = OrderedDict()  # least recently heard first
        self._notes = 0
        self.widely_held = float(widely_held)
        self.recompute_weight = float(recompute_weight)
        self.decode_weight = float(decode_weight)
        self.share_cap = float(share_cap)
        self.share_slack = float(share_slack)
        self.share_weight = float(share_weight)
        self.idle_exempt_hit = float(idle_exempt_hit)

    def costs(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        """Cost of ``req`` on each worker in prefill tokens (same order); ``math.inf`` for a
        worker over its share cap while another is under it.

        Raises:
            ValueError: ``workers`` is empty.
        """
        _require(workers)
        n_tok = float(req.num_tokens)
        mean = req.routed_mean if req.routed_mean is not None else \
            sum(w.routed_recent for w in workers) / len(workers)
        limit = (1.0 + self.share_cap) * mean + self.share_slack
        per_share = self.share_weight / max(mean, 1.0)
        mean_prompt = self.mean_prompt if self.mean_prompt is not None else n_tok
        share_cap_tokens = math.inf if self.share_tokens_cap is None else self.share_tokens_cap * mean_prompt
        exempt = self.idle_exempt_hit * n_tok
        capped = [w.routed_recent > limit and not (
            w.running_requests == 0 and w.queued_prefill_tokens == 0 and req.block_size * w.matched_blocks >= exempt)
            for w in workers]
        if all(capped):
            capped = [False] * len(workers)
        # depth (blocks) that more than widely_held of the views hold: the k-th deepest match
        if req.common_blocks is not None:  # a shortlist's caller counted over the whole fleet
            common = float(req.common_blocks)
        else:
            k = int(self.widely_held * len(workers)) + 1
            common = float(sorted((w.matched_blocks for w in workers), reverse=True)[k - 1]) \
                if k <= len(workers) else 0.0
        out = []
        for w in workers:
            uncached = max(0.0, n_tok - req.block_size * w.weighted_blocks)
            rare = max(0.0, n_tok - req.block_size * max(w.weighted_blocks, common))
            out.append(w.queued_prefill_tokens + uncached
                       + self.recompute_weight * rare
                       + self.decode_weight * w.running_requests
                       + per_share * min(uncached, share_cap_tokens) * (w.routed_recent - mean))
        if any(capped):
            if self.escape_prompts is not None and mean_prompt > 0:  # over the cap, but far cheaper than any within it
                bar = min(c for c, over in zip(out, capped) if not over) - self.escape_prompts * mean_prompt
                hard = (1.0 + self.hard_cap) * mean
                capped = [over and not (c < bar and w.routed_recent <= hard)
                          for c, over, w in zip(out, capped, workers)]
            out = [math.inf if over else c for c, over in zip(out, capped)]
        return out

    #: Senders whose averages `mean_prompt` takes the median of (the most recently heard).
    MAX_SENDERS = 256
    #: With several senders, the median is taken again every this many prompts (and when
    #: a sender is new), so a decision costs O(1) amortized.
    MEDIAN_EVERY = 16

    def note_prompt(self, num_tokens: int, sender: str = "") -> None:
        """Fold one routed prompt's length (tokens) from ``sender`` into `mean_prompt`: the
        sender's exponential average moves by ``1 / prompt_window`` of the difference, and
        `mean_prompt` is the median of the recent senders' averages. One client sending most
        of the requests moves its own average only; with one sender it is that average."""
        ema = self._by_sender.pop(sender, None)
        new = ema is None
        ema = float(num_tokens) if new else ema + (num_tokens - ema) / self.prompt_window
        self._by_sender[sender] = ema
        if len(self._by_sender) > self.MAX_SENDERS:
            self._by_sender.popitem(last=False)
        self._notes += 1
        if len(self._by_sender) == 1:
            self.mean_prompt = ema
        elif new or self.mean_prompt is None or self._notes % self.MEDIAN_EVERY == 0:
            self.mean_prompt = statistics.median(self._by_sender.values())

    def choose(self, req, workers, rng):
        if not req.retry and req.num_tokens > 0:  # a request counted once; an unhashed one not at all
            self.note_prompt(req.num_tokens, req.sender)
        costs = self.costs(req, workers)
        # Round away float noise so equal estimates tie and the tie-break is random.
        # Equal estimates go to the worker with the smallest recent share, then at random.
        return _argmin(workers, [(round(c, 6), round(w.routed_recent, 6)) for c, w in zip(costs, workers)], rng)


def prefix_holder(chosen: WorkerView, views: list[WorkerView], min_extra_blocks: int = 1) -> WorkerView | None:
    """The worker to name in ``prefix_location`` for a request sent to ``chosen``, or None.

    That is the other worker holding the most leading blocks of the request (any tier),
    when it holds at least ``min_extra_blocks`` more than ``chosen``; ties go to the
    first in ``views``. Pure.
    """
    best = None
    for v in views:
        if v.worker_id != chosen.worker_id and (best is None or v.matched_blocks > best.matched_blocks):
            best = v
    if best is None or best.matched_blocks < chosen.matched_blocks + min_extra_blocks:
        return None
    return best


# Other routers' policies (sglang_cache_aware, ray_prefix_affinity, dynamo_kv, llmd_precise,
# power_of_two) register themselves on import.
from kvmesh.services import field_policies as _field_policies  # noqa: E402,F401
