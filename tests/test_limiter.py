"""The shared in-flight limit: never exceeded, FIFO, resizable while in use."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.tasks.backends.limiter import ConcurrencyLimit


async def test_bound_holds_and_fifo() -> None:
    limit = ConcurrencyLimit(3)
    order: list[int] = []
    active = 0
    peak = 0

    async def worker(i: int) -> None:
        nonlocal active, peak
        await limit.acquire()
        try:
            order.append(i)
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.01)
            active -= 1
        finally:
            limit.release()

    await asyncio.gather(*(worker(i) for i in range(20)))
    assert peak == 3
    assert limit.peak == 3
    assert order == list(range(20))
    assert limit.in_use == 0


async def test_resize_wakes_waiters_and_shrinks() -> None:
    limit = ConcurrencyLimit(1)
    await limit.acquire()
    waiter = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    limit.set_limit(2)
    await asyncio.wait_for(waiter, 1)
    assert limit.in_use == 2
    limit.set_limit(1)
    third = asyncio.create_task(limit.acquire())
    limit.release()
    await asyncio.sleep(0)
    assert not third.done(), "shrinking must hold new acquirers until in_use drops below the new limit"
    limit.release()
    await asyncio.wait_for(third, 1)
    limit.release()
    assert limit.in_use == 0


async def test_cancelled_waiter_gives_no_permit_away() -> None:
    limit = ConcurrencyLimit(1)
    await limit.acquire()
    waiter = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    limit.release()
    assert limit.in_use == 0
    await asyncio.wait_for(limit.acquire(), 1)
    assert limit.in_use == 1


def test_rejects_nonpositive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ConcurrencyLimit(0)


async def test_cancel_after_wake_skipped_it() -> None:
    """A waiter cancelled, then dropped by a wake-up before it runs, must not break its own clean-up."""
    limit = ConcurrencyLimit(1)
    await limit.acquire()
    waiter = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    limit.release()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limit.in_use == 0
