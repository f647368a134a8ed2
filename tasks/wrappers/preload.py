"""Imported when a Dask worker process starts (`dask worker --preload rollflow.tasks.wrappers.preload`),
so the run's first chunk in that process does not wait a few seconds for Prefect and rollflow to import;
Dask then calls `dask_setup`, which turns down the worker's own monitors (tasks/scaleout/monitors.py).
preload_nanny.py does the same for the nanny."""

from typing import Any

from rollflow.tasks.scaleout import collector
from rollflow.tasks.scaleout.monitors import quiet_monitors
from rollflow.tasks.wrappers import prefect_tasks

__all__ = ["collector", "dask_setup", "prefect_tasks"]


def dask_setup(server: Any) -> None:
    quiet_monitors(server)
