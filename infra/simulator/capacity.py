"""The capacity model: N slots, a FIFO queue, service time growing with load.

Slots are modelled as a heap of the times each slot becomes free, not as a semaphore: a request's start
is max(arrival, earliest free slot) and its end is start + service time. The slot is booked at arrival,
so requests are served strictly in arrival order (FIFO), and the simulator then sleeps until the end, so
its capacity is exactly slots / service time whatever the event loop's own delays. With a zero service
time nothing sleeps at all: the hot path is a heap operation and a few counters.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from rollflow.infra.simulator.config import SimConfig


class QueueFull(Exception):
    """More requests waiting than max_queue: the simulator answers 503."""


@dataclass
class Counters:
    """What GET /metrics reports; in_flight = being served now, queued = waiting for a slot."""

    requests: int = 0
    completed: int = 0
    in_flight: int = 0
    queued: int = 0
    max_in_flight_seen: int = 0
    max_served_seen: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, int] = field(default_factory=dict)


class Engine(Protocol):
    """What the server needs of a capacity model (Capacity here, BatchingEngine in batching.py)."""

    async def serve(self, output_tokens: int, cached: bool = False) -> None: ...

    def busy_now(self) -> int: ...

    def resize(self) -> None: ...

    def kv_use(self) -> float: ...

    def nominal_latency_s(self) -> float: ...


class Capacity:
    """Books each request into the slot that frees first and holds it for the service time."""

    def __init__(self, config: SimConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.free_at: list[float] = [0.0] * config.slots
        self.rng = random.Random(config.seed + 1)

    def resize(self) -> None:
        """Apply a live change of `slots`: new slots are free now, removed ones are the latest-free."""
        now = time.monotonic()
        want = self.config.slots
        if want > len(self.free_at):
            self.free_at.extend([now] * (want - len(self.free_at)))
            heapq.heapify(self.free_at)
        elif want < len(self.free_at):
            self.free_at = sorted(self.free_at)[:want]
            heapq.heapify(self.free_at)

    def busy_now(self) -> int:
        """Slots occupied at this instant according to the model (each slot's bookings are back to back)."""
        now = time.monotonic()
        return sum(1 for f in self.free_at if f > now)

    def kv_use(self) -> float:
        """KV-cache use as an engine would report it, modelled as busy slots / slots."""
        return min(1.0, min(self.counters.in_flight, self.busy_now()) / self.config.slots)

    def nominal_latency_s(self) -> float:
        """The base service time (what /metrics' latency sum assumes)."""
        return self.config.latency_ms / 1000.0

    def service_s(self, output_tokens: int, busy: int) -> float:
        """latency + per-token time, stretched by contention (busy slots) and jitter."""
        cfg = self.config
        base = (cfg.latency_ms + cfg.per_token_ms * output_tokens) / 1000.0
        if cfg.contention and cfg.slots > 1:
            base *= 1.0 + cfg.contention * max(0, busy - 1) / cfg.slots
        if cfg.jitter:
            base *= 1.0 + cfg.jitter * (2.0 * self.rng.random() - 1.0)
        return base

    async def serve(self, output_tokens: int, cached: bool = False) -> None:
        """Wait in the FIFO queue for a slot, then hold it for the service time (QueueFull past max_queue)."""
        c = self.counters
        cfg = self.config
        now = time.monotonic()
        if len(self.free_at) != cfg.slots:
            self.resize()
        start = max(now, self.free_at[0])
        # Counting busy slots is O(slots): only pay for it when contention needs it.
        busy = sum(1 for f in self.free_at if f > start) + 1 if cfg.contention else 1
        end = start + self.service_s(output_tokens, busy)
        if start > now:
            if cfg.max_queue is not None and c.queued >= cfg.max_queue:
                raise QueueFull
            heapq.heapreplace(self.free_at, end)
            c.queued += 1
            if c.in_flight + c.queued > c.max_in_flight_seen:
                c.max_in_flight_seen = c.in_flight + c.queued
            try:
                await asyncio.sleep(start - now)
            finally:
                c.queued -= 1
        else:
            heapq.heapreplace(self.free_at, end)
        c.in_flight += 1
        if c.in_flight + c.queued > c.max_in_flight_seen:
            c.max_in_flight_seen = c.in_flight + c.queued
        served = min(c.in_flight, cfg.slots)
        if served > c.max_served_seen:
            c.max_served_seen = served
        try:
            delay = end - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            c.in_flight -= 1
