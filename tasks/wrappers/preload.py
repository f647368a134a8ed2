"""Imported when a Dask worker process starts (`dask worker --preload rollflow.tasks.wrappers.preload`),
so the run's first chunk in that process does not wait for rollflow to import (workers run no Prefect);
Dask then calls `dask_setup`, which turns down the worker's own monitors (tasks/scaleout/monitors.py).
preload_nanny.py does the same for the nanny."""

from typing import Any

from rollflow.tasks.scaleout.monitors import quiet_monitors
from rollflow.tasks.wrappers import worker_chunks

__all__ = ["dask_setup", "worker_chunks"]


def dask_setup(server: Any) -> None:
    quiet_monitors(server)
