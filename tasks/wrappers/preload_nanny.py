"""A Dask nanny's preload (`dask worker --preload-nanny rollflow.tasks.wrappers.preload_nanny`): the
nanny's tick monitor slowed as in its worker (tasks/scaleout/monitors.py), without importing Prefect or
rollflow's collector into the nanny."""

from typing import Any

from rollflow.tasks.scaleout.monitors import quiet_monitors

__all__ = ["dask_setup"]


def dask_setup(server: Any) -> None:
    quiet_monitors(server)
