"""Thin Prefect @task wrappers over the reverify core: plan, one chunk (retried), compare, publish."""

from __future__ import annotations

import asyncio
from collections import Counter
from functools import partial

from prefect import task
from prefect.cache_policies import NONE
from prefect.runtime import task_run

from rollflow.settings import redact
from rollflow.tasks.collect.stoppable import run_stoppable
from rollflow.tasks.publish.drop_chunks import drop_chunk_data
from rollflow.tasks.reverify.chunk import ReverifyContext, ReverifyOutcome, reverify_chunk
from rollflow.tasks.reverify.compare import Comparison, compare_run
from rollflow.tasks.reverify.plan import ReverifyPlan, plan_reverify
from rollflow.tasks.reverify.publish import publish_jsonl, publish_parquet, write_failures
from rollflow.tasks.reverify.runtime import ReverifyHandles
from rollflow.tasks.reverify.source import SourceChunk, rescorable_keys
from rollflow.tasks.wrappers.prefect_tasks import CHUNK_TASK, Dispatch, dispatched
from rollflow.tasks.wrappers.refusals import REFUSALS, Refusal, unrefused

# A reverify chunk runs, and is retried, as a collected one is; only its name differs.
REVERIFY_CHUNK_TASK = {**CHUNK_TASK, "name": "reverify-chunk"}


@task(name="plan-reverify", cache_policy=NONE)
async def _plan_reverify(handles: ReverifyHandles) -> ReverifyPlan | Refusal:
    h = handles
    try:
        return await run_stoppable(
            lambda stopped: plan_reverify(
                h.spec, h.store, h.ledger, h.source_options, h.output_options, stopped=stopped
            )
        )
    except REFUSALS as exc:
        return Refusal(exc)


async def plan_reverify_task(handles: ReverifyHandles) -> ReverifyPlan:
    return unrefused(await _plan_reverify(handles))


@task(**REVERIFY_CHUNK_TASK)
async def reverify_chunk_task(ctx: ReverifyContext, chunk: SourceChunk) -> ReverifyOutcome:
    try:
        return await reverify_chunk(ctx, chunk, attempt=task_run.run_count or 1)
    except Exception as exc:
        raise redact.redacted_error(exc) from None


@task(**REVERIFY_CHUNK_TASK)
async def reverify_chunk_remote_task(dispatch: Dispatch, chunk: SourceChunk) -> ReverifyOutcome:
    """A reverify chunk's task run, kept in the flow process while a Dask or Ray worker rescores it."""
    return await dispatched(dispatch, chunk)


@task(name="compare", cache_policy=NONE)
async def compare_task(handles: ReverifyHandles, plan: ReverifyPlan) -> Comparison:
    manifests = await asyncio.to_thread(handles.ledger.committed)
    threshold = handles.spec.verify.correct_threshold
    source = plan.source
    rescorable = (
        partial(rescorable_keys, source.url, options=handles.source_options)
        if source.mode == "failed"
        else None
    )
    return await asyncio.to_thread(
        compare_run, handles.ledger, source.chunks, manifests, threshold, source.max_k, rescorable
    )


@task(name="failures", cache_policy=NONE)
async def failures_task(handles: ReverifyHandles, plan: ReverifyPlan) -> Counter[str]:
    manifests = await asyncio.to_thread(handles.ledger.committed)
    return await asyncio.to_thread(write_failures, handles.ledger, plan.source.chunks, manifests)


@task(name="publish", cache_policy=NONE)
async def publish_task(handles: ReverifyHandles, plan: ReverifyPlan) -> int:
    manifests = await asyncio.to_thread(handles.ledger.committed)
    spec = handles.spec
    if spec.format == "parquet":
        names = await asyncio.to_thread(
            publish_parquet,
            handles.ledger,
            plan.source.chunks,
            manifests,
            spec.data_url(),
            spec.dataset_url(),
            handles.output_options,
        )
        return len(names)
    return await asyncio.to_thread(
        publish_jsonl,
        handles.ledger,
        plan.source.chunks,
        manifests,
        spec.dataset_url(),
        handles.output_options,
    )


@task(name="drop-chunk-data", cache_policy=NONE)
async def drop_chunks_task(handles: ReverifyHandles, plan: ReverifyPlan) -> int:
    """The chunk objects the published rollouts.jsonl holds go (--keep-chunks keeps them); bytes freed."""
    manifests = await asyncio.to_thread(handles.ledger.committed)
    return await asyncio.to_thread(
        drop_chunk_data,
        handles.ledger,
        plan.source.chunks,
        manifests,
        handles.spec.dataset_url(),
        handles.output_options,
    )
