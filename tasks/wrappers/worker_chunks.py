"""What a Dask or Ray worker runs for a chunk (collected or reverified): plain functions, no Prefect.

The chunk's Prefect task run (its states, its retries) is kept by the flow process, as the local runner
keeps it; a worker only collects. So a worker never imports Prefect nor opens a Prefect client per chunk:
Ray starts a run's worker processes anew, and each paid about 1.5 CPU-s importing Prefect, and every
chunk on any worker paid its task engine's client set-up and state calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from dataclasses import dataclass

from rollflow.settings import RollflowSettings, redact
from rollflow.settings.reverify import ReverifySpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.reverify.chunk import ReverifyOutcome, reverify_chunk
from rollflow.tasks.reverify.runtime import context_for, open_reverify
from rollflow.tasks.reverify.source import SourceChunk, SourcePlan
from rollflow.tasks.scaleout.collector import RemoteRun, WorkerCollector
from rollflow.tasks.scaleout.node import node_sharers
from rollflow.tasks.scaleout.scope import SettingsResolver, WorkerScope
from rollflow.tasks.storage.lease import follow, owner_fence, run_guarded


@dataclass(frozen=True)
class AttemptFailed:
    """A chunk attempt's error, returned rather than raised: Dask logs every raised error on the worker
    with its whole traceback ("Compute Failed"), once per attempt, while the flow's task run reports it
    anyway (and retries it)."""

    error: Exception


def collect_remote_chunk(run: RemoteRun, chunk: ChunkSpec, attempt: int) -> ChunkOutcome | AttemptFailed:
    """One attempt of a chunk on this worker process's collector; `attempt` is the flow's task run's."""
    link = run.link
    bound = link.bind() if link is not None and hasattr(link, "bind") else link
    try:
        return WorkerCollector.get().run(dataclasses.replace(run, link=bound), chunk, attempt)
    except Exception as exc:
        return _failed(exc)


class WorkerError(Exception):
    """An attempt's error whose class the flow may not have (a library only workers install) or that does
    not pickle: its class name and text, as the worker saw them."""


class WorkerLost(Exception):
    """A chunk's worker process died on every attempt the engine made of it (Dask's allowed failures, Ray's
    task retries): the chunk is not retried once more, which would only kill more workers."""


def _failed(exc: Exception) -> AttemptFailed:
    error = redact.redacted_error(exc)
    if not isinstance(error, Exception) or not _travels(error):
        error = WorkerError(f"{type(error).__name__}: {error}")
    error.__traceback__ = None  # the worker's frames stay on the worker
    return AttemptFailed(error)


def _travels(error: BaseException) -> bool:
    """Whether the flow can rebuild `error`: a builtin's or rollflow's, and it pickles."""
    module = type(error).__module__
    if module != "builtins" and not module.startswith("rollflow."):
        return False
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class ReverifyJob:
    """What a reverify chunk brings to a worker besides the chunk: the spec, the source's plan, what bounds
    it and how to fill its secrets."""

    spec: ReverifySpec
    source: SourcePlan
    scope: WorkerScope
    resolve: SettingsResolver | None = None


def reverify_remote_chunk(
    job: ReverifyJob, chunk: SourceChunk, attempt: int
) -> ReverifyOutcome | AttemptFailed:
    """One attempt of a reverify chunk with this process's own store, ledger and verifier (its verifier
    processes sized for the node's worker processes); commits only while the run's lease holder is
    `job.scope.owner`, and stops the chunk once that lease is gone."""
    try:
        return asyncio.run(_reverify(job, chunk, attempt))
    except Exception as exc:
        return _failed(exc)


async def _reverify(job: ReverifyJob, chunk: SourceChunk, attempt: int) -> ReverifyOutcome:
    scope = job.scope
    try:
        settings = RollflowSettings()
        if job.resolve is not None:
            settings = await job.resolve(settings)
        handles = open_reverify(job.spec, settings)
        ctx = context_for(handles, job.source, sharers=await asyncio.to_thread(node_sharers))
        work = reverify_chunk(ctx, chunk, attempt=attempt)
        if scope.owner is None:
            return await work
        handles.ledger.fence = owner_fence(handles.store, scope.owner, scope.margin_s)
        return await run_guarded(work, follow(handles.store, scope.owner, scope.check_s, scope.margin_s))
    finally:
        await close_loop_session()  # the http verifier's session belongs to this chunk's own loop
