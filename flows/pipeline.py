"""The rollflow pipeline as Prefect flows: plan -> collect chunks -> verify -> concatenate -> report."""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect.artifacts import acreate_markdown_artifact
from prefect.runtime import deployment as runtime_deployment

from rollflow.flows.artifacts import dataset_link, endpoints_table, rollout_progress, run_log
from rollflow.flows.collectors import choose_collectors, collect_spec
from rollflow.flows.flow_type import flow
from rollflow.flows.messages import deadline_message, incomplete_message
from rollflow.flows.parameters import (
    AS_SERVED_BACKEND,
    AS_SERVED_COLLECTION,
    AS_SERVED_ENGINE,
    AS_SERVED_TUNING,
    AS_SERVED_VERIFY,
    COMMAND_STARTED,
    described,
    refusal,
    run_name,
    run_spec,
    runtime_values,
)
from rollflow.flows.scale_out import CollectResult, collect_remote
from rollflow.flows.secrets import resolve_secret_blocks
from rollflow.flows.stops import SERVED_REFUSALS, cancelled_by_sigterm, chunk_error, served_refusal
from rollflow.settings import (
    BackendParams,
    CollectionSettings,
    RollflowSettings,
    RunSpec,
    TuningSettings,
    VerifySettings,
    redact,
)
from rollflow.settings.models import EngineSettings, url_notes
from rollflow.tasks.backends.engine_metrics import EngineSampler, engine_gauges, sample_endpoints
from rollflow.tasks.backends.http import auth_headers, close_loop_session
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.clock import StageClock
from rollflow.tasks.collect.forecast import (
    Measured,
    against_actual,
    forecast,
    forecast_text,
    probe_settling,
    tuned_rates,
)
from rollflow.tasks.collect.plan import RunPlan, with_chunk_rows
from rollflow.tasks.collect.progress import ProgressEvent, hub, resume_text
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.routing import used_agents, with_agents
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.runtime import RunHandles, collect_context, default_chunks_in_flight, open_run
from rollflow.tasks.collect.scheduler import run_chunks
from rollflow.tasks.collect.settle import learnable_target, settling_report
from rollflow.tasks.publish.audit import AuditSummary
from rollflow.tasks.publish.card import write_card
from rollflow.tasks.publish.concat import PublishFailed
from rollflow.tasks.publish.endpoints import endpoint_rows
from rollflow.tasks.publish.metrics import overhead_figures, run_metrics
from rollflow.tasks.publish.report import build_report, embedded_images, render_markdown, write_report
from rollflow.tasks.publish.story import run_story
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.lease import Lease
from rollflow.tasks.storage.ledger import IdentityMismatch
from rollflow.tasks.tuning.adaptive import adaptive_control
from rollflow.tasks.tuning.engine_control import engine_control
from rollflow.tasks.tuning.fail_fast import BackendRejects
from rollflow.tasks.verify.pool import close_pools
from rollflow.tasks.wrappers.prefect_tasks import (
    collect_chunk_task,
    concatenate_task,
    drop_chunks_task,
    lease_task,
    nemo_gym_files_task,
    parquet_task,
    plan_task,
    preflight_task,
    verify_task,
)
from rollflow.tasks.wrappers.refusals import unrefused


class RunIncomplete(Exception):
    """The audit found gaps, so the dataset was not published (the report says what is missing)."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


async def collect_stage(
    ctx: CollectContext, plan: RunPlan, chunks_in_flight: int, deadline_s: float | None = None
) -> CollectResult:
    """Run the pending chunks as Prefect tasks in this process, through the scheduler of every runner.

    At the deadline, or when this stage is cancelled (lease lost, Ctrl-C), every running chunk is
    cancelled (saving its finished rollouts as parts) and awaited before this returns or raises, so no
    chunk commits after its run. Whatever committed stays committed.
    """
    collect = collect_chunk_task.with_options(retries=ctx.collection.chunk_retries)

    async def run_one(chunk: ChunkSpec) -> ChunkOutcome:
        t0 = time.perf_counter()
        outcome = unrefused(await collect(ctx, chunk))
        outcome.task_s = time.perf_counter() - t0
        return outcome

    enough = until_learnable(ctx.collection, plan)
    done = await run_chunks(plan.pending, run_one, chunks_in_flight, deadline_s, chunk_error, enough)
    return CollectResult.of(done)


def until_learnable(collection: CollectionSettings, plan: RunPlan) -> Any:
    """--until-learnable: the scheduler's stop once committed chunks hold that many mixed tasks."""
    target = learnable_target(collection.until_learnable, plan.committed, (c.index for c in plan.pending))
    return None if target is None else target.reached


async def run_collection(spec: RunSpec, settings: RollflowSettings, handles: RunHandles) -> dict[str, Any]:
    """Hold the output's lease for the whole run; losing it cancels and awaits every writer of the run."""
    lease = Lease(handles.store, settings.pipeline.lease_ttl_s)
    await lease_task(handles, lease)
    handles.ledger.fence = lease.check
    handles.lease_owner, handles.lease_margin_s = lease.owner, lease.margin_s
    try:
        return await lease.guard(_collect_verify_publish(spec, settings, handles))
    finally:
        await asyncio.to_thread(lease.release)


TUNE_MIN_ROLLOUTS_PER_DIAGNOSE_ROW = 4  # below 4x the diagnosis size, tuning would eat most of the run
FALLBACK_PARALLELISM = CollectionSettings().parallelism
TUNING_AT_DEADLINE = (
    "the deadline came while diagnosing or tuning: nothing was collected; the probes' finished rollouts "
    "are saved as parts, which the next run adopts"
)


@dataclass
class Collected:
    """What the collect step did: the chunks' outcomes, its context and its own time and CPU."""

    result: CollectResult
    ctx: CollectContext
    seconds: float = 0.0
    cpu_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


async def _collect_verify_publish(
    spec: RunSpec, settings: RollflowSettings, handles: RunHandles
) -> dict[str, Any]:
    """The pipeline: plan -> choose parallelism -> collect -> verify -> publish -> report."""
    t_start, clock = time.perf_counter(), handles.clock
    mode = spec.collection.parallelism
    plan = await plan_task(handles, mode if isinstance(mode, int) else None)
    say_resumed(plan)
    asked, spec = spec, with_chunk_rows(spec, plan.identity.chunk_size)  # the report keeps what was asked
    spec = handles.spec = used_agents(spec, plan.scan.agents)
    clock.mark("startup")
    left = None if spec.deadline_s is None else max(0.0, spec.deadline_s - (time.perf_counter() - t_start))
    rejected: BackendRejects | None = None
    try:
        async with asyncio.timeout(left):
            parallelism, extra = await choose_step(spec, settings, handles, plan)
    except TimeoutError:
        collected = Collected(CollectResult(stopped=True), collect_context(handles, settings, 1))
        collected.extra = {"tuning_stopped": TUNING_AT_DEADLINE}
    except BackendRejects as exc:  # the backend answered no probe: report it, collect nothing
        rejected = exc
        collected = Collected(CollectResult(), collect_context(handles, settings, 1))
        collected.extra = {"tuning_failed": exc.as_dict()}
    else:
        left = None if left is None else max(0.0, spec.deadline_s - (time.perf_counter() - t_start))
        limits = extra.get("tuning", {}).get("limits") or parallelism  # several endpoints: each its own
        follow = extra.pop("controller", None) == "engine"
        guess = await forecast_step(spec, handles, plan, extra)
        collectors = choose_collectors(spec, extra, follow, _remaining(spec, plan), len(plan.pending))
        if spec.runner == "local":  # another runner's workers are its collectors: report.json's `workers`
            extra["collectors"] = collectors.as_dict()
        spec = handles.spec = collect_spec(spec, collectors)
        collected = await collect_step(spec, settings, handles, plan, limits, left, follow)
        collected.extra = {**extra, **collected.extra}
        collected.extra["forecast"] = against_actual(guess, *actual_figures(collected))
    await not_needed(spec, handles, plan, collected)
    clock.mark("collect")
    summary = await verify_task(handles, plan)
    clock.mark("verify")
    try:
        published, failed = await publish_step(spec, handles, plan, summary, collected.result), None
    except PublishFailed as exc:  # a full disk: the report says so, then the one-paragraph error
        published, failed = False, exc
        collected.extra["publish_error"] = str(exc)
    if published and nemo_gym_style(spec):
        files = collected.extra["nemo_gym_files"] = await nemo_gym_files_task(handles, plan)
        plan.scan.warnings.extend(
            f"aggregate metrics: {p}" for p in files.get("aggregate_metrics_problems", [])
        )
    if published and spec.format == "jsonl" and not spec.keep_chunks:
        collected.extra["chunk_data"] = await drop_chunks_step(handles, plan)
    clock.mark("publish")
    try:
        report = await report_step(asked, handles, plan, summary, collected, published)
    except OSError:
        if failed is None:
            raise
    if rejected is not None:
        raise rejected
    if failed is not None:
        raise failed
    if collected.result.stopped and not published:
        raise RunIncomplete(deadline_message(summary, spec), report)
    if not published:
        raise RunIncomplete(incomplete_message(summary, spec, collected.result.errors), report)
    return report


async def not_needed(spec: RunSpec, handles: RunHandles, plan: RunPlan, collected: Collected) -> None:
    """--until-learnable: once the target is reached, the chunks never started leave the run's plan, so
    the audit expects none of their rollouts and the dataset ends with the chunks that ran."""
    target = spec.collection.until_learnable
    if target is None:
        return
    result = collected.result
    committed = await asyncio.to_thread(handles.ledger.committed)
    reached = learnable_target(target, committed, ())
    if reached is None:
        return
    found = reached.before
    if not reached.reached([]):
        if result.errors or result.stopped or len(committed) < len(plan.scan.chunks):
            return  # not every chunk ran: the audit says what is missing; a later run goes on
        collected.extra["until_learnable"] = {
            "target": target,
            "learnable_tasks": found,
            "reached": False,
            "chunks_not_needed": 0,
            "tasks_not_collected": 0,
            "reason": f"target not reached: the input ran out at {found:,} of {target:,} tasks with mixed "
            "outcomes",
        }
        return
    keep = {c.index for c in plan.scan.chunks if c.index in committed or c.index in result.started}
    left = [c for c in plan.scan.chunks if c.index not in keep]
    plan.scan.chunks = [c for c in plan.scan.chunks if c.index in keep]
    reason = (
        f"stopped once {found:,} committed tasks had mixed outcomes (target {target:,}); {len(left):,} "
        "chunks of the input were not collected and are not missing"
        if left
        else f"the target ({target:,}) was reached with {found:,} tasks with mixed outcomes, but every chunk "
        "had started by then, so the whole input was collected (fewer chunks at once stop sooner: "
        "--chunks-in-flight)"
    )
    collected.extra["until_learnable"] = {
        "target": target,
        "learnable_tasks": found,
        "reached": True,
        "chunks_not_needed": len(left),
        "tasks_not_collected": sum(c.good_rows for c in left),
        "reason": reason,
    }


async def forecast_step(
    spec: RunSpec, handles: RunHandles, plan: RunPlan, extra: dict[str, Any]
) -> dict[str, Any]:
    """The run's forecast from the rates tuning measured (and, settling, the probes' tasks), said before
    the first chunk starts."""
    col = spec.collection
    rate, latency = tuned_rates(extra.get("tuning"))
    probed = (0, 0)
    if col.settle_after is not None:
        probed = await asyncio.to_thread(
            probe_settling,
            handles.ledger,
            plan.pending,
            col.num_repeats,
            col.settle_after,
            spec.verify.correct_threshold,
        )
    reached = learnable_target(col.until_learnable, plan.committed, (c.index for c in plan.pending))
    measured = Measured(
        tasks=0 if reached is not None and reached.reached([]) else sum(c.good_rows for c in plan.pending),
        num_repeats=col.num_repeats,
        settle_after=col.settle_after,
        until_learnable=col.until_learnable,
        rollouts_per_s=rate,
        backend_s_per_rollout=latency,
        probe_tasks=probed[0],
        probe_settled=probed[1],
    )
    guess = forecast(measured)
    # said when it tells more than tasks x repeats: rates were measured, or a rule changes the rollouts
    if rate is not None or col.settle_after is not None or col.until_learnable is not None:
        text = forecast_text(guess)
        hub.emit(ProgressEvent("forecast", text=text))
        run_log(text)
    return guess


def actual_figures(collected: Collected) -> tuple[int, float, float]:
    """(rollouts this run added, collect seconds, backend seconds) to set against the forecast."""
    outcomes = collected.result.outcomes
    rollouts = sum(o.collected + o.adopted for o in outcomes)
    backend = sum(float(o.manifest.stats.get("backend_s", 0.0)) for o in outcomes if not o.skipped)
    return rollouts, collected.seconds, backend


def nemo_gym_style(spec: RunSpec) -> bool:
    """An agent run published as JSONL whose servers the head server named, or given NeMo Gym's way (its
    dataset file named by +output_jsonl_fpath or -o, rollflow's files in FILE.rollflow/): NeMo Gym's files
    beside the dataset too."""
    if spec.format != "jsonl" or spec.backend.kind.value != "agent":
        return False
    named = spec.dataset is not None and spec.output.rstrip("/") == f"{spec.dataset}.rollflow"
    return named or any(server.server is not None for server in spec.backend.agents.values())


async def choose_step(
    spec: RunSpec, settings: RollflowSettings, handles: RunHandles, plan: RunPlan
) -> tuple[int, dict[str, Any]]:
    """A fixed parallelism as given; `adaptive` (and `auto` on a long run) over engines with gauges
    follows them from their own capacity; else `auto`/`adaptive` diagnose and tune first, unless too
    little is left."""
    mode, pending = spec.collection.parallelism, plan.pending
    if isinstance(mode, int):
        return mode, {}
    if not pending:
        return plan.identity.parallelism or FALLBACK_PARALLELISM, {}
    remaining = _remaining(spec, plan)
    if await follows_engine(spec, settings, remaining):
        return FALLBACK_PARALLELISM, {"controller": "engine"}
    needed = TUNE_MIN_ROLLOUTS_PER_DIAGNOSE_ROW * spec.tuning.diagnose_rows * len(spec.backend.urls)
    if remaining < needed:
        return FALLBACK_PARALLELISM, {
            "tuning_skipped": f"only {remaining} rollouts left: too few to diagnose and tune (needs "
            f"{needed}); collected at parallelism {FALLBACK_PARALLELISM}"
        }
    from rollflow.flows.tuning import choose_parallelism

    budget = math.floor(spec.tuning.probe_share * remaining)
    return await choose_parallelism(spec, settings, handles, plan, probe_budget=budget)


def _remaining(spec: RunSpec, plan: RunPlan) -> int:
    """Rollouts the pending chunks hold (some may be adopted from probes)."""
    return sum(c.good_rows for c in plan.pending) * spec.collection.num_repeats


async def follows_engine(spec: RunSpec, settings: RollflowSettings, remaining: int) -> bool:
    """`adaptive`, or `auto` for a long run, on local workers whose engines publish their gauges: the
    limit follows them from the engine's own capacity, with no tuning first."""
    mode = spec.collection.parallelism
    if spec.runner != "local" or (mode == "auto" and remaining < spec.tuning.engine_min_rollouts):
        return False
    if mode == "auto" and isinstance(spec.collectors, int) and spec.collectors > 1:
        return False  # tuned once, then shared by the processes, as on Dask's workers
    try:
        backend = spec.backend_settings(settings.backend.api_key)
        gauges = await engine_gauges(spec.backend.urls, auth_headers(backend))
    finally:
        await close_loop_session()
    return any(sample is not None for sample in gauges.values())


async def collect_step(
    spec: RunSpec,
    settings: RollflowSettings,
    handles: RunHandles,
    plan: RunPlan,
    parallelism: int | dict[str, int],
    left_s: float | None,
    follow_engine: bool = False,
) -> Collected:
    """Collect the pending chunks locally, adaptively or on Dask, under one deadline and one cancellation.

    `parallelism` is the total (split evenly over the endpoints) or each endpoint's limit by URL.
    """
    pending = plan.pending
    total = sum(c.good_rows for c in pending) * spec.collection.num_repeats
    hub.emit(ProgressEvent("plan", total=total))
    collected = Collected(CollectResult(), collect_context(handles, settings, parallelism))
    if not pending:
        return collected
    t0, cpu0 = time.perf_counter(), time.process_time()
    await preflight_task(spec.backend.url, spec.backend.connect_timeout_s)
    try:
        async with (
            sample_endpoints(collected.ctx.pool, auth_headers(collected.ctx.backend)) as samplers,
            rollout_progress(total),
        ):
            if follow_engine:
                collected.result = await _follow_engine(spec, plan, collected, samplers, left_s)
            else:
                collected.result = await _dispatch(spec, handles, plan, collected, left_s)
    finally:
        await close_loop_session()
    collected.seconds, collected.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return collected


async def _dispatch(
    spec: RunSpec, handles: RunHandles, plan: RunPlan, collected: Collected, left_s: float | None
) -> CollectResult:
    ctx, col = collected.ctx, spec.collection
    if spec.runner != "local":
        return await collect_remote(
            spec,
            plan.pending,
            ctx.pool.limits(),
            col.chunk_retries,
            left_s,
            handles.lease_owner,
            handles.lease_margin_s,
            until_learnable(col, plan),
        )
    in_flight = col.chunks_in_flight or default_chunks_in_flight(
        ctx.limit.limit, col.chunk_size, col.num_repeats
    )
    if col.parallelism == "adaptive":
        async with adaptive_control(ctx) as controller:
            result = await collect_stage(ctx, plan, in_flight, left_s)
        collected.extra["adaptive"] = controller.report()
        return result
    return await collect_stage(ctx, plan, in_flight, left_s)


async def _follow_engine(
    spec: RunSpec,
    plan: RunPlan,
    collected: Collected,
    samplers: dict[str, EngineSampler],
    left_s: float | None,
) -> CollectResult:
    """Collect locally while each endpoint's limit follows its engine; the decisions go to the report."""
    ctx, col = collected.ctx, spec.collection
    async with engine_control(ctx.pool, samplers) as controller:
        # enough chunks for the limit to grow well past its start
        in_flight = col.chunks_in_flight or default_chunks_in_flight(
            4 * ctx.limit.limit, col.chunk_size, col.num_repeats
        )
        result = await collect_stage(ctx, plan, in_flight, left_s)
    collected.extra["adaptive"] = controller.report()
    return result


async def publish_step(
    spec: RunSpec, handles: RunHandles, plan: RunPlan, summary: AuditSummary, result: CollectResult
) -> bool:
    """Concatenate only what the audit passed (or what --allow-incomplete accepts), never after a deadline."""
    # A deadline that came after every chunk committed stopped nothing: the audit passed, so it publishes.
    if not (summary.ok or spec.allow_incomplete) or (result.stopped and not summary.ok):
        return False
    if spec.format == "parquet":
        await parquet_task(handles, plan)
    else:
        await concatenate_task(handles, plan)
    await dataset_link(spec.published_url())
    return True


async def drop_chunks_step(handles: RunHandles, plan: RunPlan) -> dict[str, Any]:
    """The chunk objects the dataset now holds go; a store that refuses keeps them, and the report says so."""
    try:
        return {"kept": False, "freed_bytes": await drop_chunks_task(handles, plan)}
    except OSError as exc:
        return {"kept": True, "why": redact.redact(f"{type(exc).__name__}: {exc}")}


async def report_step(
    spec: RunSpec,
    handles: RunHandles,
    plan: RunPlan,
    summary: AuditSummary,
    collected: Collected,
    published: bool,
) -> dict[str, Any]:
    """report.json and report.md in the output, and the report as a Prefect markdown artifact."""
    result, skipped = collected.result, len(plan.scan.chunks) - len(plan.pending)
    metrics = run_metrics(result.outcomes, collected.ctx, handles.clock.elapsed(), collected.seconds, skipped)
    if result.peak_in_flight is not None:
        metrics.peak_in_flight = result.peak_in_flight
    metrics.stages = handles.clock.rounded()
    metrics.collect_cpu_s = round(collected.cpu_s, 6)
    metrics.peak_rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    ignored = [note for o in result.outcomes for note in o.manifest.stats.get("ignored_parts", [])]
    report = build_report(
        input_url=spec.input,
        output_url=spec.output,
        dataset_url=spec.published_url(),
        backend_kind=spec.backend.kind.value,
        summary=summary,
        metrics=metrics,
        published=published,
        bad_rows=plan.scan.bad_rows,
        adopted=sum(o.probe_sessions.get(handles.ledger.session, 0) for o in result.outcomes),
        extra={
            **collected.extra,
            "chunk_errors": result.errors[:20],
            "warnings": plan.scan.warnings,
            "stopped_at_deadline": result.stopped,
            "ignored_parts": ignored[:20],
            "parts_not_deleted": [o.parts_left for o in result.outcomes if o.parts_left][:20],
            "run_id": handles.ledger.run_id,
            "spec": redact.redact_value(spec.parameters()),  # credentials in addresses (user:pw@host) masked
            "chunk_size": plan.identity.chunk_size,
            **overhead_figures(handles.clock, result.outcomes),
            "endpoints": endpoint_rows(
                collected.ctx.pool, result.outcomes, handles.spec.runner != "local", collected.seconds
            ),
            **remote_figures(handles.spec, result),  # the runner the chunks ran on (collectors: Dask's)
            "format": spec.format,
            **settling_figures(spec, summary),
            "story": await asyncio.to_thread(run_story, spec, plan.identity, summary, handles.ledger),
        },
    )
    await asyncio.to_thread(write_report, handles.store, report)
    if published:
        await asyncio.to_thread(
            write_card, spec.published_url(), handles.dataset_options, report, handles.store
        )
    await asyncio.to_thread(owned.settle, handles.store, handles.dataset_options)
    images = await asyncio.to_thread(embedded_images, handles.store, report)
    await acreate_markdown_artifact(
        render_markdown(report, images), key="rollflow-report", description="rollflow run report"
    )
    await endpoints_table(report["endpoints"])
    _log_outcome(report, published)
    return report


def settling_figures(spec: RunSpec, summary: AuditSummary) -> dict[str, Any]:
    """report.json's `settling` section when the run settles tasks."""
    after = spec.collection.settle_after
    if after is None:
        return {}
    figures = settling_report(
        after,
        spec.collection.num_repeats,
        spec.verify.correct_threshold,
        summary.settled_tasks,
        summary.settled_rollouts,
        summary.rows_written,
    )
    return {"settling": figures}


def say_resumed(plan: RunPlan) -> None:
    """A run resuming into its output says so, with how much is there, before anything else runs."""
    resumed = plan.resumed()
    if resumed is not None:
        done, total = resumed
        hub.emit(ProgressEvent("resume", total=total, done=done))
        run_log(resume_text(done, total))


def _log_outcome(report: dict[str, Any], published: bool) -> None:
    """The run's outcome and its warnings as lines in the flow run's logs (the UI's Logs tab)."""
    rate = report.get("rollouts_per_s")
    said = "published" if published else "not published"
    where = f"; dataset {report['dataset']}" if report.get("dataset") else ""
    run_log(
        f"{said}: {report.get('rows_written', 0):,} rollouts"
        + (f" at {rate:,.1f} rollouts/s" if isinstance(rate, int | float) and rate > 0 else "")
        + f"{where}; report {str(report.get('output', '')).rstrip('/')}/report.md"
    )
    for said in report.get("warnings") or []:
        run_log(said, logging.WARNING)
    for key in ("tuning_skipped", "tuning_stopped", "publish_error"):
        if report.get(key):
            run_log(f"{key.replace('_', ' ')}: {report[key]}", logging.WARNING)
    if report.get("chunk_errors"):
        run_log(
            f"{len(report['chunk_errors'])} chunk errors, first: {report['chunk_errors'][0]}", logging.WARNING
        )


def remote_figures(spec: RunSpec, result: CollectResult) -> dict[str, Any]:
    """Dask and Ray: each worker process's figures, and the most the share book ever let them hold."""
    if spec.runner == "local":
        return {}
    return {
        "runner": spec.runner,
        "share_book_errors": result.book_errors[:20],
        "workers": [{k: v for k, v in w.items() if k != "endpoints"} for w in result.workers],
        "peak_in_flight_allowed": result.peak_allowed,
    }


async def _open_and_run(spec: RunSpec, started_at: float | None) -> dict[str, Any]:
    """`started_at` (epoch seconds) is when the command began; without it, the flow's start is the start."""
    clock = StageClock() if started_at is None else StageClock(start=started_at)
    clock.flow_started = time.time()
    settings = await resolve_secret_blocks(RollflowSettings())
    spec = await with_agents(spec)
    handles = open_run(spec, settings)
    handles.clock = clock
    try:
        return await run_collection(spec, settings, handles)
    finally:
        close_pools()  # this process's verifier processes; a Dask worker's close when it exits


@flow(name="rollflow-run", log_prints=False, flow_run_name=run_name)
@described()  # the docstring's Args, from PARAMETER_HELP
async def rollflow_run(
    input: str,
    output: str,
    dataset: str | None = None,
    format: Literal["jsonl", "parquet"] | None = None,
    backend: BackendParams = AS_SERVED_BACKEND,
    collection: CollectionSettings = AS_SERVED_COLLECTION,
    verify: VerifySettings = AS_SERVED_VERIFY,
    tuning: TuningSettings = AS_SERVED_TUNING,
    engine: EngineSettings = AS_SERVED_ENGINE,
    restart: bool | None = None,
    allow_incomplete: bool | None = None,
    keep_chunks: bool | None = None,
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """The whole pipeline: collect -> verify -> concatenate (diagnosis and tuning come first when asked).

    Every field a run leaves out keeps its served value (the ROLLFLOW_* settings of the process that
    serves the flow); a section's fields merge one by one, so `collection={"limit": 4}` changes the limit
    alone.
    """
    given = dict(locals())
    settings = RollflowSettings()
    try:
        spec = run_spec(given, settings).expanded(runtime_values())
        for note in url_notes():  # a served run's: the CLI says its own before the run
            run_log(note, logging.WARNING)
        return await cancelled_by_sigterm(_open_and_run(spec, COMMAND_STARTED.get()))
    except IdentityMismatch as exc:
        if runtime_deployment.id is None:
            raise
        return served_refusal(refusal(exc, spec, settings))
    except SERVED_REFUSALS as exc:
        if runtime_deployment.id is None:
            raise
        return served_refusal(exc)


# `rollflow collect` (ng_collect_rollouts' arguments) runs the same flow: the two differ only in defaults.
rollflow_collect = rollflow_run
