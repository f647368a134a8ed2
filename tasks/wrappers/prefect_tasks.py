"""Thin Prefect @task wrappers over the plain functions of tasks/: resolve, call, record."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import State
from prefect.runtime import task_run

from rollflow.settings import redact
from rollflow.tasks.backends.preflight import check_reachable
from rollflow.tasks.collect.chunk import ChunkOutcome, collect_chunk
from rollflow.tasks.collect.plan import RunPlan, plan_stoppable
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.runtime import RunHandles
from rollflow.tasks.collect.scheduler import stopping
from rollflow.tasks.publish.audit import AuditSummary, audit_run
from rollflow.tasks.publish.concat import concatenate, concatenate_tasks
from rollflow.tasks.publish.drop_chunks import drop_chunk_data
from rollflow.tasks.publish.nemo_gym_files import write_aggregate_metrics, write_sidecar
from rollflow.tasks.reverify.source import SourceChanged
from rollflow.tasks.storage.lease import Lease, LeaseLost, OutputGone
from rollflow.tasks.storage.store import StorageFull, describe_error, storage_full
from rollflow.tasks.wrappers.refusals import REFUSALS, Refusal, unrefused
from rollflow.tasks.wrappers.worker_chunks import WorkerLost


@task(name="plan", cache_policy=NONE)
async def _plan(handles: RunHandles, parallelism: int | None) -> RunPlan | Refusal:
    try:
        return await plan_stoppable(
            handles.spec,
            handles.store,
            handles.ledger,
            handles.input_options,
            parallelism,
            handles.dataset_options,
        )
    except REFUSALS as exc:
        return Refusal(exc)


async def plan_task(handles: RunHandles, parallelism: int | None) -> RunPlan:
    return unrefused(await _plan(handles, parallelism))


@task(name="lease", cache_policy=NONE)
async def _lease(handles: RunHandles, lease: Lease) -> Refusal | None:
    try:
        await asyncio.to_thread(handles.store.check_writable)
        await asyncio.to_thread(lease.acquire)
    except REFUSALS as exc:
        return Refusal(exc)
    return None


async def lease_task(handles: RunHandles, lease: Lease) -> None:
    unrefused(await _lease(handles, lease))


@task(name="preflight", cache_policy=NONE)
async def _preflight(url: str, timeout_s: float) -> Refusal | None:
    try:
        await check_reachable(url, timeout_s)
    except REFUSALS as exc:
        return Refusal(exc)
    return None


async def preflight_task(url: str, timeout_s: float) -> None:
    unrefused(await _preflight(url, timeout_s))


def worth_retrying(task: object, task_run: object, state: State) -> bool:
    """A lost lease or a deleted output does not come back on a retry: the chunk ends at once (a retry
    scheduled meanwhile would outlive the run's cancellation by its delay). Nor is a chunk retried whose
    worker died on every attempt the engine already made (WorkerLost), nor one whose source was rewritten.
    Nor a chunk whose run is stopping (Ctrl-C, SIGTERM, the deadline): an error raised while its attempt
    unwound (a flush that failed on the way out) is not a failure to retry, and a retry would collect on
    after the stop, holding the process (and a `rollflow serve` waiting for it) for a whole attempt."""
    if stopping():
        return False
    return not isinstance(state.data, LeaseLost | OutputGone | WorkerLost | SourceChanged)


CHUNK_TASK = {
    "name": "collect-chunk",
    "task_run_name": "chunk-{chunk.index:05d}",
    "cache_policy": NONE,
    "retries": 3,
    "retry_delay_seconds": [1, 5, 15],
    "retry_condition_fn": worth_retrying,
}


@task(**CHUNK_TASK)
async def collect_chunk_task(ctx: CollectContext, chunk: ChunkSpec) -> ChunkOutcome | Refusal:
    """A chunk on a full or read-only disk is refused (no retry, no traceback): the run stops there."""
    try:
        return await collect_chunk(ctx, chunk, attempt=task_run.run_count or 1)
    except Exception as exc:
        full = storage_full(exc)
        if full is not None:
            root = ctx.ledger.store.root_url
            said = describe_error(str(full.filename or root), full, "choose another --output")
            refused = StorageFull(
                f"Output {root}: chunk {chunk.index} could not be written: {said}. Committed chunks and "
                "saved rollouts are kept; run the same command again once there is room."
            )
            refused.__cause__ = full
            return Refusal(refused)
        raise redact.redacted_error(exc) from None


# Runs a chunk on a Dask or Ray worker for the given attempt and returns its outcome (flows/scale_out.py).
Dispatch = Callable[[Any, int], Awaitable[Any]]


async def dispatched(dispatch: Dispatch, chunk: Any) -> Any:
    try:
        return await dispatch(chunk, task_run.run_count or 1)
    except Exception as exc:
        raise redact.redacted_error(exc) from None


@task(**CHUNK_TASK)
async def collect_chunk_remote_task(dispatch: Dispatch, chunk: ChunkSpec) -> ChunkOutcome:
    """A chunk's task run, kept in the flow process (its states, its retries) while a Dask or Ray worker
    collects it: workers then run no Prefect at all."""
    return await dispatched(dispatch, chunk)


@task(name="verify", cache_policy=NONE)
async def verify_task(handles: RunHandles, plan: RunPlan) -> AuditSummary:
    manifests = await asyncio.to_thread(handles.ledger.committed)
    spec = handles.spec
    return await asyncio.to_thread(
        audit_run,
        handles.ledger,
        plan.scan.chunks,
        spec.collection.num_repeats,
        manifests,
        spec.verify.correct_threshold,
    )


@task(name="parquet", cache_policy=NONE)
async def parquet_task(handles: RunHandles, plan: RunPlan) -> list[str]:
    """--format parquet: shards under <output>/data/ from the committed chunks, and tasks.jsonl."""
    from rollflow.tasks.publish.parquet import write_parquet  # pyarrow (0.15 s): only a Parquet run pays it

    manifests = await asyncio.to_thread(handles.ledger.committed)
    ordered = [manifests[c.index] for c in plan.scan.chunks if c.index in manifests]
    spec = handles.spec
    names = await asyncio.to_thread(
        write_parquet, handles.ledger, ordered, spec.published_url(), handles.dataset_options
    )
    await asyncio.to_thread(
        concatenate_tasks,
        handles.ledger,
        plan.scan.chunks,
        manifests,
        spec.dataset_url(),
        handles.dataset_options,
    )
    return names


@task(name="concatenate", cache_policy=NONE)
async def concatenate_task(handles: RunHandles, plan: RunPlan) -> int:
    manifests = await asyncio.to_thread(handles.ledger.committed)
    written = await asyncio.to_thread(
        concatenate,
        handles.ledger,
        plan.scan.chunks,
        manifests,
        handles.spec.dataset_url(),
        handles.dataset_options,
    )
    await asyncio.to_thread(
        concatenate_tasks,
        handles.ledger,
        plan.scan.chunks,
        manifests,
        handles.spec.dataset_url(),
        handles.dataset_options,
    )
    return written


@task(name="drop-chunk-data", cache_policy=NONE)
async def drop_chunks_task(handles: RunHandles, plan: RunPlan) -> int:
    """The chunk objects a JSONL publish holds go (--keep-chunks keeps them); bytes freed."""
    manifests = await asyncio.to_thread(handles.ledger.committed)
    return await asyncio.to_thread(
        drop_chunk_data,
        handles.ledger,
        plan.scan.chunks,
        manifests,
        handles.spec.dataset_url(),
        handles.dataset_options,
    )


@task(name="nemo-gym-files", cache_policy=NONE)
async def nemo_gym_files_task(handles: RunHandles, plan: RunPlan) -> dict[str, Any]:
    """NeMo Gym's failures sidecar and aggregate metrics beside the dataset; what was written."""
    spec, options = handles.spec, handles.dataset_options
    manifests = await asyncio.to_thread(handles.ledger.committed)
    indexes = [c.index for c in plan.scan.chunks if c.index in manifests]
    url = spec.dataset_url()
    found: dict[str, Any] = {
        "failures": await asyncio.to_thread(write_sidecar, handles.ledger, indexes, url, options)
    }
    if spec.collection.aggregate_metrics and not any(s.server for s in spec.backend.agents.values()):
        found["aggregate_metrics_problems"] = [
            "not written: the resources servers that compute them are named only by NeMo Gym's head server; "
            "give +head_server.host/port (or --head-server) instead of --backend-url"
        ]
    elif spec.collection.aggregate_metrics:
        found["aggregate_metrics"], problems = await write_aggregate_metrics(
            url, options, spec.backend, handles.store
        )
        if problems:
            found["aggregate_metrics_problems"] = problems
    return found
