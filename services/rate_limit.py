"""Per-tenant rate limits at the router: requests and prompt tokens per period.

``kvmesh router --tenant-request-limit 600/minute --tenant-token-limit 2000000/minute``
refuses a tenant's Generate calls past either budget with RESOURCE_EXHAUSTED, a message
naming the flag and the wait, and a ``retry-after`` trailing-metadata entry (seconds; the
HTTP front answers 429 with a ``Retry-After`` header, RFC 9110 section 10.2.3), the way
commercial APIs meter requests and tokens per minute. Other tenants keep their budgets.
`grpc_guard.TenantCap` (``--max-inflight-per-tenant``) bounds how many calls a tenant has
open at once; these limits bound how much it sends over time.

The counters live in the cluster's Redis (the router's ``--redis-url``), under
``kvmesh:{cluster}:ratelimit``, so every router replica of a cluster draws on one budget
per tenant. They use the `limits` library's sliding-window counter
(https://limits.readthedocs.io, "Sliding Window Counter": the current and previous
fixed windows' counts, the previous one weighted by how much of it the sliding window
still covers), one key pair per tenant and limit.

A request is first looked at against both budgets (nothing counted) and, if it fits
both, counted in each with the library's atomic check-and-count (`hit`), so requests
racing each other, on one router or several, are admitted only while the counters have
room. A request refused at the look spends nothing and is told the longest wait of the
budgets it is over; one that loses a race at the second budget has spent the first. Each
budget has its own counters (requests and tokens never share a key, whatever their
numbers). A request is counted when it is admitted, before it is routed: one that then
fails (no worker reachable) has spent its share, and a client's retry counts again. A prompt larger
than the whole token budget can never fit: it is refused as such with INVALID_ARGUMENT (HTTP
400), so that clients do not retry it as they retry a 429. If Redis cannot be
reached the request is admitted (fail open, logged at a limited rate): an outage of the
counters never becomes an outage of the service.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import NamedTuple

from kvmesh.services.aio import within
from kvmesh.workers.grpc_guard import LogLimiter, clip

log = logging.getLogger(__name__)

__all__ = ["TenantRateLimit", "parse_limit", "retry_after"]

_LIMIT = re.compile(r"^\s*(\d+)\s*/\s*(second|minute|hour|day)\s*$")


def parse_limit(flag: str, text: str):
    """``"N/second|minute|hour|day"`` as a `limits.RateLimitItem` (N >= 1).

    Raises:
        ValueError: anything else, naming ``flag`` and the accepted form.
    """
    from limits import parse

    m = _LIMIT.match(text or "")
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{flag} must look like N/second, N/minute, N/hour or N/day with N >= 1 "
                         f"(e.g. 600/minute), got {clip(repr(text), 60)}")
    return parse(f"{int(m.group(1))}/{m.group(2)}")


def retry_after(limit: int, cost: int, window: float, prev: int, prev_ttl: float, cur: int, cur_ttl: float) -> float:
    """Seconds until a sliding-window counter admits ``cost`` more (0: now).

    The counter's weighted count is ``prev * prev_ttl / window + cur`` (the previous fixed
    window's count, weighted by the part of it the sliding window still covers, plus the
    current window's; `limits`' "Sliding Window Counter"), and ``cost`` fits while it is at
    most ``limit - cost``. Within the current window only the previous count decays; once
    the current window ends (``cur_ttl`` seconds) its count becomes the previous one and
    decays over the next ``window`` seconds.

    Args:
        limit: the budget per window; cost: what the request needs (<= limit).
        window: the window's length (seconds).
        prev, prev_ttl: the previous window's count and the seconds until it leaves the
            sliding window (<= ``window``).
        cur, cur_ttl: the current window's count and the seconds its counter lives: it
            becomes the previous window when the current one ends, so ``cur_ttl`` is the
            rest of the current window plus one window (as `limits` keeps it).
    """
    room = limit - cost
    if prev * max(0.0, prev_ttl) / window + cur <= room:
        return 0.0
    if cur <= room:  # the previous window's share has to fall to ``room - cur``
        return max(0.0, prev_ttl - window * (room - cur) / prev)
    # after the current window ends, its count decays like the previous one did
    return max(0.0, cur_ttl - window) + max(0.0, window * (1.0 - room / cur))


class _Budget(NamedTuple):
    """One budget a request is checked against: its limit, what the request costs in it
    (1 request, or its prompt tokens), its counters' name, and its flag as given."""

    item: object  # a `limits.RateLimitItem`
    cost: int
    name: str     # "requests" or "tokens"
    flag: str
    text: str


class TenantRateLimit:
    """Request and prompt-token budgets per tenant, shared through Redis by every router of
    a cluster (see the module docstring).

    Args:
        redis_url: the cluster's Redis (``redis://`` or ``rediss://``, with its password).
        cluster: the cluster name; its counters are separate from other clusters'.
        requests: the request budget, e.g. ``"600/minute"``, or None for none.
        tokens: the prompt-token budget, e.g. ``"2000000/minute"``, or None for none.
        storage: a `limits.aio.storage.Storage` to use instead of Redis (tests).

    Raises:
        ValueError: a malformed budget (`parse_limit`).
    """

    #: Seconds one check may wait on Redis before the request is admitted unchecked.
    TIMEOUT_S = 1.0

    def __init__(self, redis_url: str, cluster: str, requests: str | None = None, tokens: str | None = None,
                 storage=None):
        from limits.aio.strategies import SlidingWindowCounterRateLimiter

        self.requests = parse_limit("--tenant-request-limit", requests) if requests else None
        self.tokens = parse_limit("--tenant-token-limit", tokens) if tokens else None
        self.requests_text, self.tokens_text = requests, tokens
        if storage is None and self.enabled:
            from limits.aio.storage import RedisStorage

            # the library's schemes: async+redis://, async+rediss://, async+redis+unix://
            scheme, sep, rest = redis_url.partition("://")
            url = f"async+{'redis+unix' if scheme == 'unix' else scheme}{sep}{rest}"
            # redis-py's asyncio client (kvmesh's own Redis client), not the library's default
            storage = RedisStorage(url, implementation="redispy",
                                   key_prefix=f"kvmesh:{cluster}:ratelimit",
                                   socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S)
        self.storage = storage
        self.limiter = SlidingWindowCounterRateLimiter(storage) if storage is not None else None
        #: refusals per budget ("requests", "tokens") and admissions while Redis failed
        self.refused = {"requests": 0, "tokens": 0}
        self.failed_open = 0
        self._errors = LogLimiter(log, "rate-limit counter errors")

    @property
    def enabled(self) -> bool:
        return self.requests is not None or self.tokens is not None

    async def check(self, tenant: str, prompt_tokens: int) -> tuple[str, float | None] | None:
        """Count one request of ``prompt_tokens`` tokens for ``tenant`` if it fits both
        budgets; else ``(message, retry_after_seconds)`` and nothing is counted, with
        ``retry_after_seconds`` None when the prompt is larger than the whole token budget
        (no wait makes it fit).

        ``tenant`` is the one resolved from the caller's credentials ("" in open mode,
        where every caller shares one budget)."""
        if not self.enabled:
            return None
        try:
            return await within(self._check(tenant, prompt_tokens), self.TIMEOUT_S)
        except asyncio.TimeoutError:
            self.failed_open += 1
            self._errors.warn("rate limits not applied (request admitted): Redis took over %.1f s",
                                 self.TIMEOUT_S)
            return None

    async def _check(self, tenant: str, prompt_tokens: int) -> tuple[str, float | None] | None:
        who = tenant or "-"
        budgets = [b for b in (_Budget(self.requests, 1, "requests", "--tenant-request-limit", self.requests_text),
                               _Budget(self.tokens, prompt_tokens, "tokens", "--tenant-token-limit", self.tokens_text))
                   if b.item is not None]
        try:
            for b in budgets:
                if b.cost > b.item.amount:
                    self.refused[b.name] += 1
                    return (f"a prompt of {b.cost:,} tokens is larger than this tenant's whole token budget "
                            f"({b.flag} {b.text}): shorten it"), None
            # a look first (nothing counted): a request over any budget spends none, and is
            # told the longest wait, so that a client retrying when told is not refused again
            over = [b for b in budgets if not await self.limiter.test(b.item, b.name, who, cost=b.cost)]
            if not over:
                # then the atomic check-and-count per budget (`hit`): requests racing past the
                # look are admitted only while the counters have room
                for b in budgets:
                    if not await self.limiter.hit(b.item, b.name, who, cost=b.cost):
                        over = [b]  # the budgets before it counted this request (a race)
                        break
            if over:
                waits = [(await self._wait(b.item, b.name, who, b.cost), b) for b in over]
                wait, worst = max(waits, key=lambda w: w[0])
                for b in over:
                    self.refused[b.name] += 1
                return self._refusal(tenant, worst.name, worst.flag, worst.text, wait)
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: admit, never fail the request
            self.failed_open += 1
            self._errors.warn("rate limits not applied (request admitted): %s: %s", type(exc).__name__, exc)
        return None

    async def _wait(self, item, name: str, who: str, cost: int) -> float:
        """Seconds until ``cost`` more fits budget ``name`` (``item``) for ``who`` (at least
        1; the window's length when the counters cannot be read): `retry_after` of its
        counters."""
        window = float(item.get_expiry())
        try:
            prev, prev_ttl, cur, cur_ttl = await self.storage.get_sliding_window(item.key_for(name, who),
                                                                                 int(window))
        except Exception:  # noqa: BLE001
            return window
        return max(1.0, retry_after(item.amount, cost, window, prev, prev_ttl, cur, cur_ttl))

    def _refusal(self, tenant: str, name: str, flag: str, text: str, wait: float) -> tuple[str, float]:
        who = f"tenant {clip(tenant, 64)!r}" if tenant else "this caller"
        what = "requests" if name == "requests" else "prompt tokens"
        return (f"{who} is over its rate limit of {text} {what} ({flag}); retry in {math.ceil(wait)} s"), wait

    async def close(self) -> None:
        # the redis-py client inside the library's storage, when there is one
        client = getattr(getattr(self.storage, "bridge", None), "storage", None)
        close = getattr(client, "aclose", None) or getattr(client, "close", None)
        if close is not None:
            try:
                await close()
            except Exception:  # noqa: BLE001
                pass
