"""`services.aio.within`: a deadline that never loses the caller's cancellation."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.services.aio import within


async def _cancel_as_it_finishes(wait, turns: int):
    """Run ``wait(<an operation done after one loop turn>, 5)`` in a task, cancel that task
    after ``turns`` loop turns, and say how the task ended: "cancelled", "went on" (the
    cancel was requested but the task carried on), or "done before" (too late to cancel)."""
    async def operation():
        await asyncio.sleep(0)
        return 1

    async def caller():
        await wait(operation(), 5)
        await asyncio.sleep(0.01)  # a request that carried on would reach its next await here
        return "went on"

    task = asyncio.create_task(caller())
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.done() or not task.cancel():
        return "done before"
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_that_lands_as_the_operation_finishes_still_cancels_the_caller():
    """Whatever loop turn the cancel lands on, including the one where the awaited
    operation has just finished, the caller ends cancelled; never "went on" (what
    `asyncio.wait_for` does on some turn before Python 3.12)."""
    async def run():
        return [await _cancel_as_it_finishes(within, turns) for turns in range(8)]

    outcomes = asyncio.run(run())
    assert "went on" not in outcomes, outcomes
    assert outcomes.count("cancelled") >= 2, outcomes  # the sweep did reach the operation's last turns


def test_within_returns_the_result_and_times_out():
    async def run():
        assert await within(asyncio.sleep(0, result="x"), 1) == "x"
        assert await within(asyncio.sleep(0, result="y"), None) == "y"
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(10), 0.05)
        with pytest.raises(TimeoutError):  # the same class from Python 3.11: callers may catch either
            await within(asyncio.sleep(10), 0.05)
        return True

    assert asyncio.run(run())
