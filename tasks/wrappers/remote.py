"""A chunk collected in another process (a Dask worker): everything rebuilt from the spec and the env.

A worker needs only what travels in the spec (output URI, backend URL) plus its own environment
(storage credentials, API key); it gets its share of the run's parallelism.
"""

from __future__ import annotations

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.chunk import ChunkOutcome, collect_chunk
from rollflow.tasks.collect.http import close_loop_session
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.wrappers.runtime import collect_context, open_run


async def collect_chunk_on_worker(
    spec: RunSpec, chunk: ChunkSpec, share: int, attempt: int = 1
) -> ChunkOutcome:
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    ctx = collect_context(handles, settings, share)
    try:
        return await collect_chunk(ctx, chunk, attempt)
    finally:
        await close_loop_session()
