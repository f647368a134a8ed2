"""Dask's own periodic work in a worker process that runs rollflow's chunks, turned down.

Dask's statistical profiler samples every running task's thread 100 times a second; rollflow's chunk
tasks only wait there for the collector loop (tasks/scaleout/collector.py), so it records nothing useful
while it wakes the worker's event loop and takes the GIL from the collector. Its tick monitor wakes the
loop 50 times a second to time it, and its memory monitor reads the process's memory 10 times a second
(in the worker, to spill and pause; in the nanny, to restart a worker past 95% of its memory limit). An
idle worker and its nanny cost 0.86 CPU-s per 20 s with all three as Dask sets them, 0.30 with the
profiler dropped and the tick slowed, 0.10 to 0.12 with the memory monitor at once a second too (README,
"Many machines"). A tick once a second coarsens what Dask reports of its loop: the event-loop interval reads
about 1 s, and a stall is logged once two ticks are 3 s apart. A memory monitor once a second pauses or
restarts a worker whose memory runs away up to a second later (or the OS ends it first; either way its
chunk is retried); rollflow keeps no data in Dask's memory, so there is nothing to spill.
`ROLLFLOW_DASK_MONITORS=keep` leaves them as Dask configured them (`quiet`, the default, turns them down);
an interval you configured yourself is kept either way.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

KEEP_ENV = "ROLLFLOW_DASK_MONITORS"
# Each slowed monitor: Dask's default interval (any other was chosen, and is kept) and rollflow's, in ms.
# `distributed.admin.tick.interval`, `distributed.worker.memory.monitor-interval`.
SLOWED = {"tick": (20.0, 1000.0), "memory_monitor": (100.0, 1000.0)}
DASK_TICK_MS, TICK_MS = SLOWED["tick"]
DROPPED = ("profile", "profile-cycle")


def quiet_monitors(server: Any) -> list[str]:
    """Drop the profiler's callbacks and slow the default tick and memory monitor of a Dask worker or
    nanny (before or after they start); the names of what changed. Anything else (a scheduler given the
    preload) is left alone."""
    from distributed import Nanny, Worker

    if not isinstance(server, Worker | Nanny):
        return []
    given = os.environ.get(KEEP_ENV, "")
    choice = given.strip().lower()
    if choice not in ("", "keep", "quiet"):
        log.warning("%s=%r is not 'keep' or 'quiet': Dask's monitors are turned down", KEEP_ENV, given)
    if choice == "keep":
        return []
    callbacks = server.periodic_callbacks
    changed = []
    for name in DROPPED:
        callback = callbacks.pop(name, None)
        if callback is not None:
            callback.stop()
            changed.append(name)
    for name, (dask_default, slowed) in SLOWED.items():
        callback = callbacks.get(name)
        if callback is not None and callback.callback_time == dask_default:
            callback.callback_time = slowed
            changed.append(name)
    return changed
