"""Run torch work on a thread that exits when it is done.

On CPU, torch's intra-op parallelism is OpenMP, and OpenMP gives every OS thread that runs a
parallel region a thread team of its own, which outlives the region. A team left idle on a
long-lived thread (the process's main thread, a thread pool's worker, a writer loop) slows
the engine thread's parallel steps on a small CPU: measured on a 2-core VM, the engine's
prefix-hit TTFT with 50 ms between requests was 42-52 ms with the model loaded on the main
thread and 28-29 ms with it loaded on a short-lived one; 32 matmuls of ``[256, 512] x
[512, 1376]`` after a 50 ms idle gap took 4-7 % longer once a pool thread had run one
element-wise op over 4M floats, and no longer when that op ran on a short-lived thread
(``python -m kvmesh.bench.omp_teams`` prints these ratios side by side). So work that may
run parallel torch ops off the engine thread (loading the model, encoding blocks for the
disk and remote tiers, exporting blocks to peers, staging fetched ones, prefetching from
disk) runs here, on a new thread that takes its team with it when it exits. A thread
start costs tens of microseconds, small next to any such call.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

__all__ = ["run_on_fresh_thread", "to_fresh_thread"]

T = TypeVar("T")


def run_on_fresh_thread(fn: Callable[..., T], *args, name: str = "kvmesh-torch", **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread, waiting for it; returns its result.

    Raises:
        whatever ``fn`` raises, re-raised in the caller's thread.
    """
    box: dict = {}

    def body() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def to_fresh_thread(fn: Callable[..., T], *args, name: str = "kvmesh-torch", **kwargs) -> T:
    """Like ``asyncio.to_thread`` but on a new thread that exits afterwards; the event loop
    keeps running meanwhile.

    Raises:
        whatever ``fn`` raises.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if done.cancelled():
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def body() -> None:
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed back to the awaiting task
            out = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *out)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting
            pass

    threading.Thread(target=body, name=name, daemon=True).start()
    return await done
