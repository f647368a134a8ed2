"""Imported when a worker process starts (`dask worker --preload rollflow.tasks.wrappers.preload`), so the
run's first chunk in that process does not wait a few seconds for Prefect and rollflow to import."""

from rollflow.tasks.scaleout import collector
from rollflow.tasks.wrappers import prefect_tasks

__all__ = ["collector", "prefect_tasks"]
