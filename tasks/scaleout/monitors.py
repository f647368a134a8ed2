"""Dask's own periodic work in a worker process that runs rollflow's chunks, turned down.

Dask's statistical profiler samples every running task's thread 100 times a second; rollflow's chunk
tasks only wait there for the collector loop (tasks/scaleout/collector.py), so it records nothing useful
while it wakes the worker's event loop and takes the GIL from the collector. Its tick monitor wakes the
loop 50 times a second to time it. An idle worker and its nanny cost 1.27 CPU-s per 20 s with both, 0.29
with them turned down (README, "Many machines"). A tick once a second coarsens what Dask reports of its
loop: the event-loop interval reads about 1 s, and a stall is logged once two ticks are 3 s apart.
`ROLLFLOW_DASK_MONITORS=keep` leaves them as Dask configured them (`quiet`, the default, turns them down);
a tick you configured yourself is kept either way.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

KEEP_ENV = "ROLLFLOW_DASK_MONITORS"
TICK_MS = 1000.0
DASK_TICK_MS = 20.0  # Dask's default `distributed.admin.tick.interval`: any other was chosen, and is kept
DROPPED = ("profile", "profile-cycle")


def quiet_monitors(server: Any) -> list[str]:
    """Drop the profiler's callbacks and slow a default tick of a Dask worker or nanny (before or after
    they start); the names of what changed. Anything else (a scheduler given the preload) is left alone."""
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
    tick = callbacks.get("tick")
    if tick is not None and tick.callback_time == DASK_TICK_MS:
        tick.callback_time = TICK_MS
        changed.append("tick")
    return changed
