"""chunked-collect on a Dask cluster: chunk tasks go to worker processes through Prefect's Dask runner.

The blocking Dask calls run in a thread that stops when told (deadline, lease lost, Ctrl-C): it cancels
the futures and leaves the runner, which closes a local cluster's workers. Workers of an existing cluster
stop their chunk themselves at the deadline or when the run's lease is gone (tasks/remote.py).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rollflow.flows.secrets import resolve_secret_blocks
from rollflow.settings import RunSpec, redact
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.endpoints import scale_limits, split_limit
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.wrappers.prefect_tasks import collect_chunk_remote_task
from rollflow.tasks.wrappers.remote import WorkerScope

POLL_S = 0.1


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


def endpoint_shares(spec: RunSpec, parallelism: int | dict[str, int], threads: int) -> dict[str, int]:
    """Each chunk's share of every endpoint's limit: a worker spreads over all endpoints, like one process.

    The shares sum to the chunk's share of the total, not to one slot per endpoint at least: an endpoint
    may get 0 fixed slots and is still used as the chunk's slots free up.
    """
    urls = spec.backend.urls
    limits = split_limit(parallelism, urls) if isinstance(parallelism, int) else parallelism
    limits = {url: limits[url] for url in urls}
    return scale_limits(limits, worker_share(sum(limits.values()), threads))


def _collect_blocking(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    parallelism: int | dict[str, int],
    retries: int,
    scope: WorkerScope,
    stop: threading.Event,
) -> CollectResult:
    result = CollectResult()
    with _runner(spec) as runner:
        workers = runner.client.scheduler_info()["workers"].values()
        share = endpoint_shares(spec, parallelism, sum(w.get("nthreads", 1) for w in workers))
        task = collect_chunk_remote_task.with_options(retries=retries)
        params = {"share": share, "scope": scope, "resolve": resolve_secret_blocks}
        pending = [runner.submit(task, {"spec": spec, "chunk": c, **params}) for c in chunks]
        while pending and not stop.wait(POLL_S):
            for future in [f for f in pending if f.wrapped_future.done()]:
                pending.remove(future)
                try:
                    result.outcomes.append(future.result())
                except Exception as exc:
                    result.errors.append(redact.redact(f"{type(exc).__name__}: {exc}"))
        if pending:
            runner.client.cancel([f.wrapped_future for f in pending])
            result.stopped = True
    return result


async def collect_on_dask(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    parallelism: int | dict[str, int],
    retries: int,
    deadline_s: float | None = None,
    owner: str | None = None,
) -> CollectResult:
    """`parallelism` is the run's total or its per-endpoint limits; each chunk gets its share of each.

    Blocking Dask futures run off the flow's event loop (context variables travel with to_thread).

    Stopped at `deadline_s` or by cancellation; either way the thread is awaited before this returns
    or raises, so no chunk of this run is still running when it does.
    """
    stop = threading.Event()
    stop_at = None if deadline_s is None else time.time() + deadline_s
    scope = WorkerScope(stop_at=stop_at, owner=owner)
    work = asyncio.ensure_future(
        asyncio.to_thread(_collect_blocking, spec, chunks, parallelism, retries, scope, stop)
    )
    cancelled = False
    try:
        await asyncio.wait({work}, timeout=deadline_s)
    except asyncio.CancelledError:
        cancelled = True
    stop.set()
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return work.result()
