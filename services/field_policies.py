"""Other routers' policies, reimplemented on kvmesh's block hashes.

Each class below follows one project's public documentation (and, where the documentation
leaves a detail open, its published source) with that project's default parameters, so
that `bench.sim` can replay a trace through them and through kvmesh's own ``kv_aware`` on
the same caches, index and load model. They register by name like the built-in policies
and can also be given to a live router (``kvmesh router --policy NAME``).

| name | source | what it looks at |
|---|---|---|
| ``sglang_cache_aware`` | SGLang router, ``cache_aware`` policy | router-side prefix tree, in-flight requests |
| ``ray_prefix_affinity`` | Ray Serve LLM ``PrefixCacheAffinityRouter`` | router-side prefix tree, queue lengths |
| ``dynamo_kv`` | NVIDIA Dynamo KV router | KV-event index overlap, prefill and decode load |
| ``llmd_precise`` | llm-d precise prefix-cache, queue and KV-utilization scorers | KV-event index, queue, KV use |
| ``power_of_two`` | power of two choices (Mitzenmacher 2001) | in-flight requests of two random workers |

Translation to kvmesh's signals (`services.policies.WorkerView`):

* Text becomes blocks. The SGLang and Ray routers match prompt *characters* in a radix
  tree of what they routed; here the tree holds the request's chained block hashes (equal
  hash at position ``i`` = equal prefix through block ``i``), and a match rate is matched
  tokens over prompt tokens, ``min(N, B * matched_blocks) / N``.
* "Load" / "queue length" of SGLang and Ray is the router's count of requests sent to a
  worker and not yet finished: ``running_requests`` (the router's in-flight count).
* Dynamo's active decode blocks and llm-d's KV utilization come from the worker's pool:
  ``total_blocks - free_blocks`` blocks are held by running requests (cached blocks that
  nothing holds count as free, as in vLLM's ``gpu_cache_usage_perc``).
* Dynamo's and llm-d's overlap is the precise, KV-event-fed index match
  (``weighted_blocks``: leading blocks held, credited by tier).
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Iterable, Sequence

from kvmesh.services.policies import RouteRequest, RoutingPolicy, WorkerView, _argmin, _require, register

__all__ = [
    "RoutedPrefixTree",
    "SGLangCacheAwarePolicy",
    "RayPrefixAffinityPolicy",
    "DynamoKVPolicy",
    "LlmdPrecisePolicy",
    "PowerOfTwoPolicy",
]

#: Characters per token assumed when a source bounds its tree in characters (the usual
#: rule of thumb for English text with BPE tokenizers).
CHARS_PER_TOKEN = 4


def _match_rate(req: RouteRequest, matched_blocks: int) -> float:
    """Matched prompt tokens over prompt tokens, in [0, 1]."""
    if req.num_tokens <= 0:
        return 0.0
    return min(req.num_tokens, req.block_size * matched_blocks) / req.num_tokens


def _argmax(workers: Sequence[WorkerView], keys: Sequence, rng: random.Random) -> WorkerView:
    best = max(keys)
    tied = [w for w, k in zip(workers, keys) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _min_max(values: Sequence[float], equal: float = 1.0) -> list[float]:
    """``(v - min) / (max - min)`` per value; ``equal`` for all when max == min."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [equal] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


class RoutedPrefixTree:
    """What one router sent where: the block hashes of every prompt it routed, per worker.

    The approximate trees of SGLang's cache-aware router and of Ray Serve's
    PrefixCacheAffinityRouter record the router's own routing history (the engines'
    caches are never consulted). Over chained block hashes a set of hashes per worker is
    that tree: a worker matches the leading run of a request's hashes it holds. Each
    worker's entries are kept in LRU order, leaves before their parents, and trimmed to
    ``max_tokens`` (tokens, counted as ``blocks x block_size``) when an insert exceeds it.

    Args:
        max_tokens: per-worker bound in tokens; None keeps everything.
    """

    __slots__ = ("max_tokens", "_holders", "_lru")

    def __init__(self, max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self.max_tokens = max_tokens
        self._holders: dict[bytes, set[str]] = {}
        self._lru: dict[str, OrderedDict] = {}

    def match(self, block_hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` recorded for each of ``worker_ids`` (blocks)."""
        result = {w: 0 for w in worker_ids}
        alive = set(result)
        n = 0
        for h in block_hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            nxt = alive & holders
            if not nxt:
                break
            for w in alive - nxt:
                result[w] = n
            alive = nxt
            n += 1
        for w in alive:
            result[w] = n
        return result

    def insert(self, worker_id: str, block_hashes: Sequence[bytes], block_size: int = 1) -> None:
        """Record that ``worker_id`` was sent a prompt with these block hashes."""
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        # Parents end up more recent than their children, so trimming takes leaves first.
        for h in reversed(block_hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders = self._holders.get(h)
                if holders is None:
                    self._holders[h] = {worker_id}
                else:
                    holders.add(worker_id)
        if self.max_tokens is not None:
            cap = max(1, self.max_tokens // max(1, block_size))
            while len(lru) > cap:
                h, _ = lru.popitem(last=False)
                holders = self._holders[h]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]

    def size(self, worker_id: str) -> int:
        """Blocks recorded for ``worker_id``."""
        lru = self._lru.get(worker_id)
        return 0 if lru is None else len(lru)


@register
class SGLangCacheAwarePolicy(RoutingPolicy):
    """SGLang router's ``cache_aware`` policy.

    Source: SGLang model gateway (``sgl-router``), policy ``cache_aware``; rule from its
    documentation and the ``CacheAwarePolicy`` doc comment, defaults from
    ``sglang_router.router_args.RouterArgs`` (github.com/sgl-project/sglang,
    ``sgl-router/py_src/sglang_router/router_args.py``):
    ``cache_threshold = 0.3``, ``balance_abs_threshold = 64``,
    ``balance_rel_threshold = 1.5``, ``max_tree_size = 2**26`` characters (its
    ``eviction_interval_secs = 120`` trims periodically; here the tree is trimmed on insert).

    With ``load_i`` the router's in-flight requests on worker ``i``:

    1. The system is imbalanced when ``max(load) - min(load) > balance_abs_threshold`` and
       ``max(load) > balance_rel_threshold * min(load)``; then the least-loaded worker wins.
    2. Otherwise the worker whose router-side tree holds the longest prefix of the request
       wins if its match rate (matched tokens / prompt tokens) exceeds ``cache_threshold``;
    3. else the worker with the smallest tree (the most room to cache new data).

    The chosen worker's tree then records the request (`RoutedPrefixTree`). Ties are broken
    at random.
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2 ** 26):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0 or max_tree_size < 1:
            raise ValueError("balance_abs_threshold >= 0, balance_rel_threshold >= 1 and max_tree_size >= 1 required")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = max_tree_size
        self.tree = RoutedPrefixTree(max_tokens=max(1, max_tree_size // CHARS_PER_TOKEN))

    def choose(self, req, workers, rng):
        _require(workers)
        loads = [w.running_requests for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            pick = _argmin(workers, loads, rng)
        else:
            matched = self.tree.match(req.block_hashes, [w.worker_id for w in workers])
            best = max(matched.values()) if matched else 0
            if best and _match_rate(req, best) > self.cache_threshold:
                pick = _argmax(workers, [matched[w.worker_id] for w in workers], rng)
            else:
                pick = _argmin(workers, [self.tree.size(w.worker_id) for w in workers], rng)
        self.tree.insert(pick.worker_id, req.block_hashes, req.block_size)
        return pick


@register
class RayPrefixAffinityPolicy(RoutingPolicy):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``.

    Source: Ray Serve LLM documentation, "PrefixCacheAffinityRouter for LLM inference
    optimization" (docs.ray.io, serve/llm/prefix-aware-request-router), and its
    ``initialize_state`` defaults: ``imbalanced_threshold = inf`` (earlier releases used
    10), ``match_rate_threshold = 0.1``, ``do_eviction = False`` (the tree is never
    trimmed).

    With ``queue_i`` the requests in flight on replica ``i``:

    1. Load is balanced when ``max(queue) - min(queue) <= imbalanced_threshold``. Then the
       router matches the request against its prefix tree of routed prompts: if the best
       match rate (matched tokens / prompt tokens) is at least ``match_rate_threshold``
       the candidates are the replicas holding that longest match, otherwise the replicas
       with the smallest trees.
    2. When imbalanced, or with no candidates, the default power-of-two choices applies:
       two random replicas.
    3. Of the candidates, the one with the shortest queue is taken (ties at random).

    The chosen replica's tree then records the request (`RoutedPrefixTree`).
    """

    name = "ray_prefix_affinity"

    def __init__(self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1):
        if imbalanced_threshold < 0 or not 0.0 <= match_rate_threshold <= 1.0:
            raise ValueError("imbalanced_threshold >= 0 and match_rate_threshold in [0, 1] required")
        self.imbalanced_threshold = float(imbalanced_threshold)
        self.match_rate_threshold = float(match_rate_threshold)
        self.tree = RoutedPrefixTree()

    def choose(self, req, workers, rng):
        _require(workers)
        queues = [w.running_requests for w in workers]
        candidates: list[WorkerView] = []
        if max(queues) - min(queues) <= self.imbalanced_threshold:
            matched = self.tree.match(req.block_hashes, [w.worker_id for w in workers])
            best = max(matched.values()) if matched else 0
            if best and _match_rate(req, best) >= self.match_rate_threshold:
                candidates = [w for w in workers if matched[w.worker_id] == best]
            else:
                sizes = [self.tree.size(w.worker_id) for w in workers]
                smallest = min(sizes)
                candidates = [w for w, s in zip(workers, sizes) if s == smallest]
        if not candidates:
            candidates = rng.sample(list(workers), min(2, len(workers)))
        pick = _argmin(candidates, [w.running_requests for w in candidates], rng)
        self.tree.insert(pick.worker_id, req.block_hashes, req.block_size)
        return pick


@register
class DynamoKVPolicy(RoutingPolicy):
    """NVIDIA Dynamo's KV router.

    Source: Dynamo documentation, "KV Cache Routing" (github.com/ai-dynamo/dynamo,
    ``docs/architecture/kv_cache_routing.md``, section "Cost Calculation") and the router
    flags ``--kv-overlap-score-weight`` (default 1), ``--router-kv-overlap-score-credit``
    (default 1: a device-cached block saves its whole prefill) and
    ``--router-temperature`` (default 0: the cheapest worker). For worker ``i``, a request
    of ``N`` tokens and blocks of ``B`` tokens::

        prefill_blocks_i = (queued_prefill_tokens_i + N - overlap_credit * B * overlap_i) / B
        decode_blocks_i  = active_blocks_i + ceil(N / B)
        cost_i           = overlap_score_weight * prefill_blocks_i + decode_blocks_i

    ``overlap_i`` is the leading blocks the KV-event index says ``i`` holds
    (``weighted_blocks``), ``active_blocks_i`` the blocks its running requests hold
    (``total_blocks - free_blocks``). With ``router_temperature = 0`` the lowest cost wins
    (ties at random); above 0 a worker is sampled with probability proportional to
    ``exp(-c_i / router_temperature)`` where ``c_i`` is its cost min-max normalized to
    [0, 1] (Dynamo's "softmax sampling of router cost logits").
    """

    name = "dynamo_kv"

    def __init__(self, overlap_score_weight: float = 1.0, overlap_credit: float = 1.0,
                 router_temperature: float = 0.0):
        if overlap_score_weight < 0 or not 0.0 <= overlap_credit <= 1.0 or router_temperature < 0:
            raise ValueError("overlap_score_weight >= 0, overlap_credit in [0, 1], router_temperature >= 0 required")
        self.overlap_score_weight = float(overlap_score_weight)
        self.overlap_credit = float(overlap_credit)
        self.router_temperature = float(router_temperature)

    def costs(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        """Dynamo's cost of ``req`` on each worker, in blocks (same order)."""
        _require(workers)
        bs = max(1, req.block_size)
        n = float(req.num_tokens)
        req_blocks = math.ceil(n / bs)
        out = []
        for w in workers:
            prefill_tokens = w.queued_prefill_tokens + max(0.0, n - self.overlap_credit * bs * w.weighted_blocks)
            active = max(0, w.total_blocks - w.free_blocks)
            out.append(self.overlap_score_weight * prefill_tokens / bs + active + req_blocks)
        return out

    def choose(self, req, workers, rng):
        costs = self.costs(req, workers)
        if self.router_temperature <= 0 or len(workers) == 1:
            return _argmin(workers, [round(c, 6) for c in costs], rng)
        norm = _min_max(costs, equal=0.0)
        weights = [math.exp(-c / self.router_temperature) for c in norm]
        return rng.choices(list(workers), weights=weights, k=1)[0]


@register
class LlmdPrecisePolicy(RoutingPolicy):
    """llm-d's precise prefix-cache-aware scheduling profile.

    Sources: llm-d inference scheduler, ``precise-prefix-cache-scorer`` (scores each pod by
    the leading blocks its KV events say it holds, min-max normalized over the pods with a
    hit: all 1.0 when they tie, 0 for pods without a hit); the Gateway API Inference
    Extension ``queue-scorer`` (``(max - q) / (max - min)`` over waiting-queue lengths, 1.0
    when all are equal) and ``kv-cache-utilization-scorer`` (``1 - KV cache usage``); the
    ``max-score-picker``; weights from llm-d's precise prefix-cache-aware guide:
    prefix 3, queue 2, KV utilization 2::

        score_i = 3 * prefix_i + 2 * queue_i + 2 * (1 - used_blocks_i / total_blocks_i)

    The highest score wins, ties at random. ``prefix_i`` uses ``weighted_blocks`` (the
    index match credited by tier), ``queue_i`` the worker's ``waiting_requests``.
    """

    name = "llmd_precise"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_utilization_weight: float = 2.0):
        if min(prefix_weight, queue_weight, kv_utilization_weight) < 0:
            raise ValueError("scorer weights must be >= 0")
        self.prefix_weight = float(prefix_weight)
        self.queue_weight = float(queue_weight)
        self.kv_utilization_weight = float(kv_utilization_weight)

    def scores(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        """Weighted score of each worker (same order); higher is better."""
        _require(workers)
        hits = [w.weighted_blocks for w in workers]
        with_hit = [h for h in hits if h > 0]
        if with_hit:
            lo, hi = min(with_hit), max(with_hit)
            prefix = [0.0 if h <= 0 else (1.0 if hi == lo else (h - lo) / (hi - lo)) for h in hits]
        else:
            prefix = [0.0] * len(workers)
        waiting = [float(w.waiting_requests) for w in workers]
        lo_q, hi_q = min(waiting), max(waiting)
        queue = [1.0 if hi_q == lo_q else (hi_q - q) / (hi_q - lo_q) for q in waiting]
        kv = [1.0 - (max(0, w.total_blocks - w.free_blocks) / w.total_blocks if w.total_blocks > 0 else 0.0)
              for w in workers]
        return [self.prefix_weight * p + self.queue_weight * q + self.kv_utilization_weight * k
                for p, q, k in zip(prefix, queue, kv)]

    def choose(self, req, workers, rng):
        scores = self.scores(req, workers)
        return _argmax(workers, [round(s, 9) for s in scores], rng)


@register
class PowerOfTwoPolicy(RoutingPolicy):
    """Power of two choices: of two workers drawn at random, the one with fewer requests in
    flight (ties at random).

    Source: M. Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
    IEEE TPDS 12(10), 2001; the default router of Ray Serve and the ``power_of_two`` policy
    of SGLang's router. Load is ``running_requests`` (the router's in-flight count).
    """

    name = "power_of_two"

    def choose(self, req, workers, rng):
        _require(workers)
        if len(workers) == 1:
            return workers[0]
        a, b = rng.sample(list(workers), 2)
        if a.running_requests == b.running_requests:
            return rng.choice((a, b))
        return a if a.running_requests < b.running_requests else b
