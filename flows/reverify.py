"""rollflow-reverify: a published output scored again, chunk by chunk, under the output's lease.

plan -> rescore chunks (retryable tasks, a bounded number at once) -> compare -> publish -> report.
No backend is asked; a run stopped anywhere resumes at its first uncommitted chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prefect.artifacts import acreate_markdown_artifact

from rollflow.flows.engines import open_engine
from rollflow.flows.flow_type import flow
from rollflow.flows.scale_out import EngineThread, RemoteChunks, settled
from rollflow.flows.secrets import resolve_secret_blocks, worker_secrets
from rollflow.flows.stops import cancelled_by_sigterm, chunk_error
from rollflow.settings import RollflowSettings, redact
from rollflow.settings.reverify import VERIFY_FAILURE_KINDS, ReverifySpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.collect.scheduler import run_chunks
from rollflow.tasks.publish.card import write_card
from rollflow.tasks.reverify.chunk import ReverifyContext, ReverifyOutcome
from rollflow.tasks.reverify.plan import ReverifyPlan, check_apart
from rollflow.tasks.reverify.report import build_report, render_markdown, write_report
from rollflow.tasks.reverify.runtime import ReverifyHandles, open_reverify, reverify_context
from rollflow.tasks.reverify.source import SourceChanged
from rollflow.tasks.scaleout.scope import WorkerScope
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.lease import Lease
from rollflow.tasks.verify.pool import close_pools
from rollflow.tasks.wrappers.prefect_tasks import lease_task
from rollflow.tasks.wrappers.reverify_tasks import (
    compare_task,
    drop_chunks_task,
    failures_task,
    plan_reverify_task,
    publish_task,
    reverify_chunk_remote_task,
    reverify_chunk_task,
)
from rollflow.tasks.wrappers.worker_chunks import ReverifyJob, reverify_remote_chunk


class ReverifyIncomplete(Exception):
    """Some rollouts failed verification or chunks are missing, so nothing was published."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class Rescored:
    outcomes: list[ReverifyOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    changed: str = ""  # the source was rewritten under the run: why, said instead of "run again"


async def rescore_stage(ctx: ReverifyContext, plan: ReverifyPlan, spec: ReverifySpec) -> Rescored:
    """The pending chunks as tasks, `chunks_in_flight` at once; a chunk that fails for good is a gap."""
    gate = asyncio.Semaphore(spec.chunks_in_flight)
    task = reverify_chunk_task.with_options(retries=spec.chunk_retries)
    done = Rescored()

    async def one(chunk: Any) -> None:
        async with gate:
            try:
                done.outcomes.append(await task(ctx, chunk))
            except Exception as exc:
                err = chunk_error(exc)
                if isinstance(err, SourceChanged):
                    done.changed = done.changed or str(err)
                done.errors.append(redact.redact(f"chunk {chunk.index}: {type(err).__name__}: {err}"))

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for chunk in plan.pending:
            group.create_task(one(chunk))
    done.seconds = time.perf_counter() - t0
    return done


async def rescore_remote(plan: ReverifyPlan, spec: ReverifySpec, lease: Lease) -> Rescored:
    """Every pending chunk as a task on Dask or Ray workers, through the engine and the chunk scheduler the
    collection's remote runners use (no share book: a check asks no backend). When the run stops or is
    cancelled, the chunk futures still running are cancelled and the runner is left before this ends; a
    worker also stops its chunk itself once the run's lease is gone."""
    t0 = time.perf_counter()
    calls = EngineThread()
    stack = contextlib.ExitStack()
    task = reverify_chunk_remote_task.with_options(retries=spec.chunk_retries)
    scope = WorkerScope(owner=lease.owner, margin_s=lease.margin_s)
    job = ReverifyJob(spec, plan.source, scope, worker_secrets())
    try:
        opened = open_engine(spec, secrets.token_hex(6), len(plan.pending), spec.chunks_in_flight, book=False)
        engine = await settled(calls.call(stack.enter_context, opened))
        remote = RemoteChunks(engine, calls, None, task, reverify_remote_chunk, job)
        in_flight = max(spec.chunks_in_flight, 2 * await calls.call(engine.slots))
        try:
            done = await run_chunks(plan.pending, remote.run, in_flight)
        finally:
            await settled(calls.call(remote.cancel_live))
    finally:
        await settled(calls.call(stack.close))
        calls.close()
    errors = [redact.redact(f"{type(exc).__name__}: {exc}") for exc in done.errors]
    changed = next((str(exc) for exc in done.errors if isinstance(exc, SourceChanged)), "")
    return Rescored(done.outcomes, errors, time.perf_counter() - t0, changed)


def _metrics(
    rescored: Rescored, stages: dict[str, float], wall_s: float, plan: ReverifyPlan
) -> dict[str, Any]:
    run = [o for o in rescored.outcomes if not o.skipped]
    rows = sum(o.manifest.rows + o.manifest.failed - o.kept for o in run)
    sums = {k: round(sum(o.timings.get(k, 0.0) for o in run), 3) for k in ("read_s", "verify_s", "write_s")}
    return {
        "wall_s": round(wall_s, 3),
        "rescore_s": round(rescored.seconds, 3),
        "rows_processed": rows,
        "rows_per_s": round(rows / rescored.seconds, 1) if rescored.seconds > 0 else None,
        "chunks_run": len(run),
        "chunks_skipped": len(plan.source.chunks) - len(plan.pending),
        "chunk_errors": rescored.errors[:20],
        "chunk_time_s": sums,
        "stages": {k: round(v, 3) for k, v in stages.items()},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def stage(text: str) -> None:
    """What the reverify is doing before its checks come, for the displays (the CLI's lines)."""
    hub.emit(ProgressEvent("stage", text=text))


def say_plan(plan: ReverifyPlan) -> None:
    """A resumed reverify says how much the output holds; then the rollouts to rescore, for the count."""
    committed = [m for i, m in plan.committed.items() if i in {c.index for c in plan.source.chunks}]
    if committed:
        total = sum(c.rows for c in plan.source.chunks)
        hub.emit(ProgressEvent("resume", total=total, done=sum(m.rows for m in committed)))
    hub.emit(ProgressEvent("plan", total=sum(c.rows for c in plan.pending)))


async def _warm(verifier: Any) -> None:
    """Start the verifier processes now, saying so, and say when they are ready: until then no check ends."""
    processes = getattr(verifier, "processes", None)
    many = "process" if processes == 1 else "processes"
    stage(f"starting {processes} verifier {many} ({verifier.name}); the first checks wait for them")
    with contextlib.suppress(Exception):  # only what is said: the checks meet any failure themselves
        seconds = await verifier.warm()
        stage(f"verifier {many} ready after {seconds:,.1f} s")


async def _rescore_local(ctx: ReverifyContext, plan: ReverifyPlan, spec: ReverifySpec) -> Rescored:
    """The chunks in this process, its verifier processes started (and said) alongside the first reads."""
    warm = getattr(ctx.verifier, "warm", None) if plan.pending else None
    warming = asyncio.create_task(_warm(ctx.verifier)) if warm is not None else None
    try:
        return await rescore_stage(ctx, plan, spec)
    finally:
        if warming is not None:
            warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warming


async def _reverify(handles: ReverifyHandles, lease: Lease) -> dict[str, Any]:
    spec, t_start = handles.spec, time.perf_counter()
    stages: dict[str, float] = {}
    stage(f"scanning the source {redact.redact(spec.source)}")
    plan = await plan_reverify_task(handles)
    ctx = reverify_context(handles, plan)
    stages["plan"] = time.perf_counter() - t_start
    say_plan(plan)
    if spec.runner != "local" and plan.pending:
        stage(f"sending {len(plan.pending):,} chunks to the {spec.runner} workers")
        rescored = await rescore_remote(plan, spec, lease)
    else:
        rescored = await _rescore_local(ctx, plan, spec)
    stages["rescore"] = rescored.seconds
    stage("comparing the rewards and publishing")
    t = time.perf_counter()
    summary = await compare_task(handles, plan)
    failures: Counter[str] = await failures_task(handles, plan)
    stages["compare"] = time.perf_counter() - t
    ok = summary.complete and ((summary.failed == 0 and summary.missing == 0) or spec.allow_incomplete)
    t = time.perf_counter()
    if ok:
        await publish_task(handles, plan)
    chunk_data = None
    if ok and spec.format == "jsonl" and not spec.keep_chunks:
        try:
            chunk_data = {"kept": False, "freed_bytes": await drop_chunks_task(handles, plan)}
        except OSError as exc:  # a store that refuses the deletes keeps the objects: said, not fatal
            chunk_data = {"kept": True, "why": redact.redact(f"{type(exc).__name__}: {exc}")}
    stages["publish"] = time.perf_counter() - t
    source = {
        "url": redact.redact(plan.source.url),
        "given": redact.redact(spec.source),
        "sha256": plan.source.fingerprint,
        "rows": plan.source.rows,
        "tasks": plan.source.tasks,
        "mode": plan.source.mode,
    }
    metrics = _metrics(rescored, stages, time.perf_counter() - t_start, plan)
    if chunk_data is not None:
        metrics["chunk_data"] = chunk_data
    report = build_report(spec, summary, source=source, published=ok, failures=failures, metrics=metrics)
    await asyncio.to_thread(write_report, handles.store, report)
    if ok:
        url = spec.data_url() if spec.format == "parquet" else spec.dataset_url()
        await asyncio.to_thread(write_card, url, handles.output_options, report, handles.store)
    await asyncio.to_thread(owned.settle, handles.store, handles.output_options)
    await acreate_markdown_artifact(
        render_markdown(report), key="rollflow-reverify-report", description="rollflow reverify report"
    )
    if not ok and rescored.changed:
        raise ReverifyIncomplete(redact.redact(rescored.changed), report)
    if not ok:
        why = (
            _failed_why(spec, failures, summary.failed)
            if summary.complete and summary.failed
            else _missing_why(spec, summary.missing)
            if summary.complete
            else f"the rescored output is incomplete: {'; '.join(summary.problems[:5])}. Run the same "
            f"command again to resume"
        )
        raise ReverifyIncomplete(f"Nothing was published: {why}.", report)
    return report


def _missing_why(spec: ReverifySpec, missing: int) -> str:
    """Rollouts the source never had: a rescoring cannot make them."""
    return (
        f"the source lacks {missing:,} rollouts of its tasks (they failed when it was collected, or its "
        "undecided tasks never got their later ones), which reverify cannot make: run the collection's "
        f"command on {spec.source} again to collect them, then this one; or pass --allow-incomplete to "
        "publish without them"
    )


def _failed_why(spec: ReverifySpec, failures: Counter[str], failed: int) -> str:
    """What to do about the rollouts left failed: a check fails again or not on a rerun; a backend's
    failure (no reply to score) never comes back through reverify, only through collecting again."""
    where = f"{spec.output.rstrip('/')}/failures.jsonl"
    backend = sum(n for kind, n in failures.items() if kind not in VERIFY_FAILURE_KINDS)
    if not backend:
        return (
            f"{failed:,} rollouts failed verification ({dict(failures)}); they are in {where}. Run the same "
            f"command again to retry them, or pass --allow-incomplete to publish without them"
        )
    return (
        f"{failed:,} rollouts have no reward ({dict(failures)}; in {where}). {backend:,} of them failed at "
        f"the backend, with no reply to score, which reverify cannot redo: run the collection's command "
        f"on {spec.source} again to collect them, then this one; or pass --allow-incomplete to publish "
        f"without them"
    )


@flow(name="rollflow-reverify", log_prints=False)
async def rollflow_reverify(spec: ReverifySpec) -> dict[str, Any]:
    """Rescore a published output with another verifier: no backend request, resumable by chunk."""
    return await cancelled_by_sigterm(_open_and_reverify(spec))


async def _open_and_reverify(spec: ReverifySpec) -> dict[str, Any]:
    settings = await resolve_secret_blocks(RollflowSettings())
    handles = open_reverify(spec, settings)
    # before the lease, which writes into the output: a refused output inside the source stays unwritten
    check_apart(spec.source, spec.output, (handles.source_options, handles.output_options))
    lease = Lease(handles.store, settings.pipeline.lease_ttl_s)
    await lease_task(handles, lease)
    handles.ledger.fence = lease.check
    try:
        return await lease.guard(_reverify(handles, lease))
    finally:
        await close_loop_session()  # the http verifier's, on the loop that owns it
        await asyncio.to_thread(lease.release)
        close_pools()
