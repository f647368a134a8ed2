"""The one bound on in-flight requests that every chunk of a process shares."""

from __future__ import annotations

import asyncio
from collections import deque


class ConcurrencyLimit:
    """A FIFO semaphore whose size can change while it is in use (for tuning and adaptive mode).

    asyncio.Semaphore cannot be resized; this one can, and it keeps the high-water mark so tests and
    reports can show the bound held.
    """

    def __init__(self, limit: int, minimum: int = 1) -> None:
        """`minimum` 0 lets the limit close entirely: a worker process whose share of the run is 0."""
        self.minimum = minimum
        if limit < minimum:
            raise ValueError(f"parallelism must be at least {minimum}, got {limit}")
        self._limit = limit
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.peak = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_use(self) -> int:
        return self._in_use

    async def acquire(self) -> None:
        if self._in_use < self._limit and not self._waiters:
            self._take()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def _take(self) -> None:
        self._in_use += 1
        if self._in_use > self.peak:
            self.peak = self._in_use

    def release(self) -> None:
        self._in_use -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        if limit < self.minimum:
            raise ValueError(f"parallelism must be at least {self.minimum}, got {limit}")
        self._limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._in_use < self._limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self._take()
                fut.set_result(None)
