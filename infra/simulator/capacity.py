"""The capacity model: N slots served at once, the rest waiting FIFO, service time growing with load."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from infra.simulator.config import SimConfig


class QueueFull(Exception):
    """More requests waiting than max_queue: the simulator answers 503."""


@dataclass
class Counters:
    requests: int = 0
    completed: int = 0
    in_flight: int = 0
    queued: int = 0
    max_in_flight_seen: int = 0
    max_served_seen: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, int] = field(default_factory=dict)


class Capacity:
    def __init__(self, config: SimConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.busy = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    def _received(self) -> int:
        return self.busy + len(self.waiters)

    async def acquire(self) -> None:
        c = self.counters
        if self.busy < self.config.slots and not self.waiters:
            self.busy += 1
        else:
            if self.config.max_queue is not None and len(self.waiters) >= self.config.max_queue:
                raise QueueFull
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            c.queued = len(self.waiters)
            c.max_in_flight_seen = max(c.max_in_flight_seen, self._received())
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self.release()
                else:
                    self.waiters.remove(fut)
                c.queued = len(self.waiters)
                raise
        c.in_flight = self.busy
        c.queued = len(self.waiters)
        c.max_served_seen = max(c.max_served_seen, self.busy)
        c.max_in_flight_seen = max(c.max_in_flight_seen, self._received())

    def release(self) -> None:
        self.busy -= 1
        self.wake()

    def wake(self) -> None:
        while self.waiters and self.busy < self.config.slots:
            fut = self.waiters.popleft()
            if not fut.done():
                self.busy += 1
                fut.set_result(None)
        self.counters.in_flight = self.busy
        self.counters.queued = len(self.waiters)

    def service_s(self, output_tokens: int) -> float:
        cfg = self.config
        base = (cfg.latency_ms + cfg.per_token_ms * output_tokens) / 1000.0
        if cfg.contention and cfg.slots > 1:
            base *= 1.0 + cfg.contention * (self.busy - 1) / cfg.slots
        return base
