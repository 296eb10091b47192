"""Waiting with a deadline without losing a cancellation.

`asyncio.wait_for` before Python 3.12 runs the awaited operation in a task of its own
and, when that task finishes in the same loop turn as the caller is cancelled, returns
its result and drops the cancellation (CPython issue gh-86296, bpo-42130; 3.12 rebuilt
`wait_for` on `asyncio.timeout`). On a request path that is a leak: an HTTP client that
resets while its request waits on a Redis round trip is never noticed, and its request
keeps its tenant's slot and its worker to the last token. `within` awaits the operation
in the caller's own task under a timeout scope (`asyncio.timeout` from 3.11, the
`async-timeout` package that aiohttp brings on 3.10), where a cancellation always
reaches the caller.
"""
from __future__ import annotations

import sys
from typing import Awaitable, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout below 3.11
    from async_timeout import timeout as _timeout

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds (None: no limit) and return its result.

    Raises:
        asyncio.TimeoutError: ``aw`` did not finish in time (it is cancelled); the builtin
            `TimeoutError` from Python 3.11, where the two are one class.
        asyncio.CancelledError: the caller was cancelled, even if ``aw`` finished in the
            same loop turn (the case `asyncio.wait_for` gets wrong before 3.12).
    """
    async with _timeout(timeout_s):
        return await aw
