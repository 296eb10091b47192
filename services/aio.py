"""Waiting with a deadline without losing a cancellation.

`asyncio.wait_for` before Python 3.12 runs the awaited operation in a task of its own
and, when that task finishes in the same loop turn as the caller is cancelled, returns
its result and drops the cancellation (CPython issue gh-86296, bpo-42130; 3.12 rebuilt
`wait_for` on `asyncio.timeout`). On a request path that is a leak: an HTTP client that
resets while its request waits on a Redis round trip is never noticed, and its request
keeps its tenant's slot and its worker to the last token. `within` awaits the operation
in the caller's own task under `asyncio.timeout` (Python 3.11+, which kvmesh requires),
where a cancellation always reaches the caller.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds (None: no limit) and return its result.

    Raises:
        TimeoutError: ``aw`` did not finish in time (it is cancelled); the same class as
            ``asyncio.TimeoutError``.
        asyncio.CancelledError: the caller was cancelled, even if ``aw`` finished in the
            same loop turn (the case `asyncio.wait_for` gets wrong before 3.12).
    """
    async with asyncio.timeout(timeout_s):
        return await aw
