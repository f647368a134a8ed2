"""A chunk's rollouts give back every permit of the shared limit, even when cancelled before they start."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.rollouts import _worker_per_permit

pytestmark = pytest.mark.concurrent


async def test_workers_cancelled_before_their_first_step_give_their_permits_back() -> None:
    limit = ConcurrencyLimit(4)
    started: list[int] = []
    hold = asyncio.Event()

    async def worker(item: int) -> None:
        started.append(item)
        await hold.wait()

    run = asyncio.create_task(_worker_per_permit(iter(range(10)), limit, worker))
    # Let the scheduler take all four permits and create four tasks, none of which has run a step yet.
    while limit.in_use < 4:
        await asyncio.sleep(0)
    assert started == []
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    for _ in range(5):
        await asyncio.sleep(0)
    assert limit.in_use == 0


async def test_workers_that_end_give_their_permits_back_and_every_item_runs() -> None:
    limit = ConcurrencyLimit(3)
    seen: list[int] = []
    source = iter(range(20))

    async def worker(item: int) -> None:
        while True:
            seen.append(item)
            await asyncio.sleep(0)
            nxt = next(source, None)
            if nxt is None:
                return
            item = nxt

    await asyncio.wait_for(_worker_per_permit(source, limit, worker), 10)
    assert sorted(seen) == list(range(20))
    assert limit.in_use == 0
