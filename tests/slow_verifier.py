"""A verifier that scores one rollout at a time (20 ms each): the bottleneck of verifier-bound runs."""

from __future__ import annotations

import asyncio

_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}


async def verify(row: dict, text: str) -> float:
    lock = _locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock:
        await asyncio.sleep(0.02)
    return 1.0 if text.rstrip().endswith(f"\\boxed{{{row.get('expected_answer')}}}") else 0.0
