"""Blocking work on a thread that a stopped run can end: an input scan, a plan. A cancelled caller asks
the work to stop and waits for its thread, so nothing it does lands after the run let go of its output
(its lease), and the process exits promptly rather than after the whole scan."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_stoppable(work: Callable[[Callable[[], bool]], T]) -> T:
    """`work(stopped)` on a thread; it asks `stopped()` now and then (every STOP_EVERY rows of a scan)
    and raises once it says True."""
    stop = threading.Event()
    thread = asyncio.ensure_future(asyncio.to_thread(work, stop.is_set))
    try:
        return await asyncio.shield(thread)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({thread})
        if not thread.cancelled():
            thread.exception()  # ScanStopped, or what the work raised first: the cancel is the outcome
        raise
