"""A chunk collected in another process (a Dask worker): everything rebuilt from the spec and the env.

A worker needs only what travels in the spec (output URI, backend URL) plus its own environment
(storage credentials, API key, or the Secret blocks they name); it gets its share of the run's
parallelism: of each endpoint's limit, so every worker spreads over all endpoints. A cancelled Dask
future does not stop a running task, so the worker itself stops the chunk at the run's deadline or when
the run's lease is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.chunk import ChunkOutcome, collect_chunk
from rollflow.tasks.collect.http import close_loop_session
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.storage.lease import follow, owner_fence, run_guarded
from rollflow.tasks.wrappers.runtime import collect_context, open_run

SettingsResolver = Callable[[RollflowSettings], Awaitable[RollflowSettings]]


@dataclass(frozen=True)
class WorkerScope:
    """What bounds a chunk on a worker: the run's deadline (epoch seconds) and the run's lease owner."""

    stop_at: float | None = None
    owner: str | None = None
    check_s: float = 1.0


async def collect_chunk_on_worker(
    spec: RunSpec,
    chunk: ChunkSpec,
    share: int | dict[str, int],
    attempt: int = 1,
    scope: WorkerScope | None = None,
    resolve: SettingsResolver | None = None,
) -> ChunkOutcome:
    """`resolve` fills secrets the way the flow does (Secret blocks); it is passed in by the flow side."""
    settings = RollflowSettings()
    if resolve is not None:
        settings = await resolve(settings)
    scope = scope or WorkerScope()
    handles = open_run(spec, settings)
    if scope.owner is not None:
        handles.ledger.fence = owner_fence(handles.store, scope.owner)
    ctx = collect_context(handles, settings, share)
    left = None if scope.stop_at is None else max(0.0, scope.stop_at - time.time())
    try:
        async with asyncio.timeout(left):
            work = collect_chunk(ctx, chunk, attempt)
            if scope.owner is None:
                outcome = await work
            else:
                outcome = await run_guarded(work, follow(handles.store, scope.owner, scope.check_s))
        outcome.endpoints = ctx.pool.rows()
        return outcome
    finally:
        await close_loop_session()
