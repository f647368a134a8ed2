"""A chunk worker on Ray: an actor that runs chunk calls, SEATS at a time, and ends itself once idle for its
keep time. Warm (`--ray-keep-workers-s`), it is detached and serves run after run; otherwise it is a run's
own and ends with it.

Ray starts a job's worker processes anew for every run, and ends them with it: each start costs about
0.5 CPU-s (Ray's worker, then rollflow's worker side) before its first chunk. A detached actor outlives the
run that started it, so the next run on the cluster finds its process started, imported (it imports the worker
side as it starts, as a Dask worker's preload does) and connected.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

NAMESPACE = "rollflow-workers"
NAME_PREFIX = "rollflow-chunks"
CHECK_S = 1.0  # how often an idle worker looks at its idle time
WORKER_SIDE = "rollflow.tasks.wrappers.worker_chunks"
# Chunk calls a worker runs at once, as a Dask worker's two threads: the second chunk takes the slots the
# first one's tail frees, where one at a time left them idle from its tail to the next chunk's start.
SEATS = 2


@ray.remote(num_cpus=1, max_restarts=0, max_concurrency=SEATS, concurrency_groups={"control": 1})
class ChunkWorker:
    """Runs `fn(*args)` calls, SEATS at a time (the default group's threads), on the process's one collector;
    `idle_s` answers from a group of its own, so it answers while chunks run."""

    def __init__(self, keep_s: float) -> None:
        importlib.import_module(WORKER_SIDE)  # before the first chunk, as a Dask worker's preload does
        self.keep_s = keep_s
        self.running = 0
        self.since = time.monotonic()
        self.lock = threading.Lock()
        threading.Thread(target=self._expire, name="rollflow-keep", daemon=True).start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            self.running += 1
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.running -= 1
                self.since = time.monotonic()

    @ray.method(concurrency_group="control")
    def keep(self, keep_s: float) -> float:
        """The keep time of the run that found this worker (the newest run's holds), and `idle_s`."""
        self.keep_s = keep_s
        return self.idle_s()

    @ray.method(concurrency_group="control")
    def idle_s(self) -> float:
        """Seconds since the last call ended, -1.0 while one runs."""
        with self.lock:
            return -1.0 if self.running else time.monotonic() - self.since

    def _expire(self) -> None:
        """Ends this actor once idle for its keep time: its CPU goes back to the cluster. A call on its way
        meanwhile fails as an actor that died, and the flow sends it to a new worker."""
        while True:
            time.sleep(min(CHECK_S, self.keep_s))
            if self.idle_s() >= self.keep_s:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return
