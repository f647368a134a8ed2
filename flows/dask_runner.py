"""chunked-collect on a Dask cluster: chunk tasks go to worker processes through Prefect's Dask runner."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from rollflow.settings import RunSpec
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.wrappers.prefect_tasks import collect_chunk_remote_task


@dataclass
class CollectResult:
    outcomes: list[ChunkOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stopped: bool = False


def _runner(spec: RunSpec) -> Any:
    from prefect_dask import DaskTaskRunner

    if spec.dask_address:
        return DaskTaskRunner(address=spec.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={"n_workers": spec.dask_workers, "threads_per_worker": 1, "processes": True}
    )


def worker_share(parallelism: int, worker_threads: int) -> int:
    """Each concurrently running chunk's part of the run-wide limit, so the total stays <= parallelism."""
    return max(1, math.floor(parallelism / max(1, worker_threads)))


def _collect_blocking(
    spec: RunSpec, chunks: list[ChunkSpec], parallelism: int, retries: int
) -> CollectResult:
    result = CollectResult()
    with _runner(spec) as runner:
        workers = runner.client.scheduler_info()["workers"].values()
        share = worker_share(parallelism, sum(w.get("nthreads", 1) for w in workers))
        task = collect_chunk_remote_task.with_options(retries=retries)
        futures = [runner.submit(task, {"spec": spec, "chunk": c, "share": share}) for c in chunks]
        for future in futures:
            try:
                result.outcomes.append(future.result())
            except Exception as exc:
                result.errors.append(f"{type(exc).__name__}: {exc}")
    return result


async def collect_on_dask(
    spec: RunSpec, chunks: list[ChunkSpec], parallelism: int, retries: int
) -> CollectResult:
    """Blocking Dask futures run off the flow's event loop (context variables travel with to_thread)."""
    return await asyncio.to_thread(_collect_blocking, spec, chunks, parallelism, retries)
