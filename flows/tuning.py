"""The diagnose-bottleneck and tune-parallelism stages as flows, and the `auto` step of `rollflow run`.

Thin: resolve settings, plan the run, call the cores through thin tasks, write throughput.png and the
diagnosis/tuning sections of the report, publish Prefect artifacts. Every probe rollout is saved as a
part, so collection (now or in a later `rollflow run` on the same output) adopts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import orjson
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact

from rollflow.flows.artifacts import run_log
from rollflow.flows.flow_type import flow
from rollflow.flows.parameters import (
    AS_SERVED_BACKEND,
    AS_SERVED_COLLECTION,
    AS_SERVED_ENGINE,
    AS_SERVED_TUNING,
    AS_SERVED_VERIFY,
    described,
    run_name,
    run_spec,
    runtime_values,
)
from rollflow.flows.secrets import resolve_secret_blocks
from rollflow.flows.stops import cancelled_by_sigterm
from rollflow.settings import (
    BackendParams,
    CollectionSettings,
    RollflowSettings,
    RunSpec,
    TuningSettings,
    VerifySettings,
)
from rollflow.settings.models import EngineSettings
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.clock import StageClock
from rollflow.tasks.collect.plan import RunPlan, with_chunk_rows
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.routing import used_agents, with_agents
from rollflow.tasks.collect.runtime import RunHandles, collect_context, open_run
from rollflow.tasks.publish.plot import (
    data_uri,
    diagnosis_markdown,
    steps_table,
    tuning_markdown,
)
from rollflow.tasks.publish.report import write_throughput_png
from rollflow.tasks.storage.lease import Lease
from rollflow.tasks.tuning.diagnose import (
    DIAGNOSIS_FILE,
    backend_key,
    diagnosis_record,
    earlier_diagnosis,
    reconcile,
)
from rollflow.tasks.tuning.fail_fast import FAILURES_FILE, BackendRejects
from rollflow.tasks.tuning.per_endpoint import (
    SharedFeed,
    combine_endpoints,
    endpoint_context,
    for_each_endpoint,
    split_reachable,
)
from rollflow.tasks.tuning.probe import ProbeFeed
from rollflow.tasks.tuning.tune import TuneOptions
from rollflow.tasks.wrappers.prefect_tasks import lease_task, plan_task, preflight_task
from rollflow.tasks.wrappers.prefect_tuning_tasks import diagnose_task, tune_task

TuningParams = TuningSettings


def _params(spec: RunSpec, params: TuningParams | None) -> TuningParams:
    """Explicit params, else the spec's own tuning settings."""
    return params if params is not None else spec.tuning


async def _publish(handles: RunHandles, found: dict[str, Any]) -> None:
    """throughput.png in the output, a table artifact of the steps, a markdown artifact with the plot."""
    parts: list[str] = []
    if "diagnosis" in found:
        d = found["diagnosis"]
        parts.append(diagnosis_markdown(d))
        run_log(f"diagnose-bottleneck: {d['verdict']}: {d['reason']}; next step: {d['next_step']}")
    if "tuning" in found:
        tuning = found["tuning"]
        run_log(
            f"tune-parallelism: knee {tuning['knee']}, chosen parallelism {tuning['chosen_parallelism']} "
            f"({tuning['total_probe_rollouts']:,} probe rollouts)"
        )
        png = await asyncio.to_thread(write_throughput_png, handles.store, tuning)
        await acreate_table_artifact(
            steps_table(tuning), key="rollflow-tuning-steps", description="tune-parallelism steps"
        )
        parts.append(tuning_markdown(tuning, image=data_uri(png)))
    await acreate_markdown_artifact(
        "# rollflow diagnosis and tuning\n\n" + "\n".join(parts),
        key="rollflow-tuning",
        description="diagnose-bottleneck and tune-parallelism",
    )


async def _diagnose_and_tune_one(
    ctx: CollectContext,
    plan: RunPlan,
    params: TuningParams,
    feed: ProbeFeed,
    tune_too: bool,
    diagnosed: Callable[[], None],
    probe_budget: int | None = None,
    earlier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One endpoint: its diagnosis (or `earlier`, one `rollflow diagnose` made), then (if asked) its
    tuning, as report.json shows them; with `probe_budget`, tuning stops once diagnosis and tuning have
    spent about that many rollouts."""
    if earlier is not None:
        seeds, spent, said = [], 0, earlier
    else:
        diagnosis = await diagnose_task(
            ctx, plan, params.diagnose_low, params.diagnose_high, params.diagnose_rows, feed
        )
        seeds, spent, said = [diagnosis.low, diagnosis.high], diagnosis.probe_rollouts, diagnosis.as_dict()
    diagnosed()
    found: dict[str, Any] = {"diagnosis": said, "chosen": params.diagnose_high}
    if tune_too:
        opts = TuneOptions.from_settings(params)
        if probe_budget is not None:
            opts = dataclasses.replace(opts, max_probe_rollouts=max(0, probe_budget - spent))
        tuning = await tune_task(ctx, plan, opts, feed, seeds)
        rates = {st.parallelism: st.rollouts_per_s for st in tuning.steps if st.errors == 0}
        advised = said.get("advised_parallelism") or 0
        clean = all(st.errors == 0 for st in tuning.steps if st.parallelism >= advised)
        chosen, note = reconcile(said, tuning.chosen_parallelism, rates, clean_above=clean)
        if note is not None:
            tuning.notes.append(note)
        if chosen != tuning.chosen_parallelism:
            tuning.choice_rule = f"the diagnosis' ceiling ({said['verdict']}), over {tuning.choice_rule}"
        if earlier is not None:
            tuning.notes.append(f"diagnosis not repeated: {earlier['reused']}")
        tuning.chosen_parallelism = chosen
        found["tuning"] = tuning.as_dict()
        found["tuning"]["total_probe_rollouts"] = tuning.probe_rollouts + spent
        found["chosen"] = chosen
    return found


async def _per_endpoint(
    ctx: CollectContext,
    plan: RunPlan,
    params: TuningParams,
    urls: list[str],
    tune_too: bool,
    clock: StageClock,
    probe_budget: int | None = None,
    earlier: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Every endpoint diagnosed and tuned at once; one endpoint gives exactly the one-backend sections
    (and may reuse `earlier`, its diagnosis from `rollflow diagnose`).

    The diagnose stage ends when the last endpoint's diagnosis does.
    """
    timeout_s = ctx.backend.connect_timeout_s
    live, down = await split_reachable(urls, lambda url: preflight_task(url, timeout_s))
    feed = SharedFeed(ctx, plan)
    waiting = len(live)

    def diagnosed() -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            clock.mark("diagnose")

    # Rows routed by agent go each to their agent's server: the pool is tuned as one, its total split.
    routed = ctx.pool.routed and len(live) > 1
    if routed:
        waiting = 1
    try:
        runs = await for_each_endpoint(
            [",".join(live)] if routed else live,
            lambda url: _diagnose_and_tune_one(
                ctx if routed else endpoint_context(ctx, url),
                plan,
                params,
                feed,
                tune_too,
                diagnosed,
                None if probe_budget is None else probe_budget // (1 if routed else len(live)),
                earlier if len(live) == 1 else None,
            ),
        )
    finally:
        feed.close()
        await close_loop_session()
    if len(runs) == 1:
        found = runs[0].value
        return found.pop("chosen"), found
    return combine_endpoints(runs, down)


async def choose_parallelism(
    spec: RunSpec,
    settings: RollflowSettings,
    handles: RunHandles,
    plan: RunPlan,
    *,
    tune_too: bool = True,
    params: TuningParams | None = None,
    probe_budget: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """Diagnose, then tune: (chosen parallelism, {"diagnosis": ..., "tuning": ...} for report.json).

    Call inside a flow, after planning and before collection; the probes' rollouts are saved as parts
    that collection adopts. With tune_too=False only the diagnosis runs (the value is the high level).
    With several endpoints each is tuned on its own, concurrently; the value is the sum of their choices
    and `tuning.limits` holds each endpoint's. When the backend answers no probe, the failures go to
    <output>/tuning_failures.jsonl and BackendRejects says what it answered.
    """
    ctx = collect_context(handles, settings, 1)
    urls = ctx.backend.urls
    tuning = _params(spec, params)
    earlier = None if spec.restart or not tune_too else await _earlier(handles, spec, urls, tuning)
    try:
        chosen, found = await _per_endpoint(
            ctx, plan, tuning, urls, tune_too, handles.clock, probe_budget, earlier
        )
    except BackendRejects as exc:
        await asyncio.to_thread(handles.store.write_bytes, FAILURES_FILE, exc.lines())
        raise exc.written_to(spec.output) from None
    await asyncio.to_thread(handles.ledger.update_parallelism, chosen)
    await _publish(handles, found)
    handles.clock.mark("tune" if tune_too else "diagnose")
    return chosen, found


def _diagnosed_key(spec: RunSpec, urls: list[str]) -> str:
    """What a diagnosis depends on besides time: the endpoints, the backend kind and model, the verifier
    and where its checks run (a diagnosis that advised more verifier processes is not reused once given)."""
    v = spec.verify
    return backend_key(
        {
            "urls": sorted(urls),
            "kind": str(spec.backend.kind),
            "model": spec.backend.model,
            "verifier": str(v.verifier),
            "verify_processes": v.processes,
            "node_processes": v.node_processes,
        }
    )


async def _earlier(
    handles: RunHandles, spec: RunSpec, urls: list[str], params: TuningParams
) -> dict[str, Any] | None:
    """The output's diagnosis of this backend, when `rollflow diagnose` made one recently enough."""
    if params.reuse_diagnosis_s <= 0 or len(urls) != 1:
        return None
    try:
        raw = await asyncio.to_thread(handles.store.read_bytes, DIAGNOSIS_FILE)
    except FileNotFoundError:
        return None
    return earlier_diagnosis(raw, _diagnosed_key(spec, urls), params.reuse_diagnosis_s)


async def _stage(spec: RunSpec, tune_too: bool) -> dict[str, Any]:
    """Probes write parts (and --restart discards chunks), so the stage holds the output's lease."""
    settings = await resolve_secret_blocks(RollflowSettings())
    spec = await with_agents(spec)
    handles = open_run(spec, settings)
    lease = Lease(handles.store, settings.pipeline.lease_ttl_s)
    await lease_task(handles, lease)
    handles.ledger.fence = lease.check
    try:
        return await lease.guard(_diagnose_and_tune(spec, settings, handles, tune_too))
    finally:
        await asyncio.to_thread(lease.release)


async def _diagnose_and_tune(
    spec: RunSpec,
    settings: RollflowSettings,
    handles: RunHandles,
    tune_too: bool,
) -> dict[str, Any]:
    plan = await plan_task(handles, None)
    spec = handles.spec = used_agents(with_chunk_rows(spec, plan.identity.chunk_size), plan.scan.agents)
    chosen, found = await choose_parallelism(spec, settings, handles, plan, tune_too=tune_too)
    record = (
        {**found, "chosen_parallelism": chosen}
        if tune_too
        else diagnosis_record(found, _diagnosed_key(handles.spec, handles.spec.backend.urls), chosen)
    )
    name = "tuning.json" if tune_too else DIAGNOSIS_FILE
    await asyncio.to_thread(handles.store.write_bytes, name, orjson.dumps(record, option=2))
    return {**found, "chosen_parallelism": chosen, "output": spec.output}


# The stages publish nothing and choose no parallelism mode, so two of their fields read differently.
STAGE_WORDING = {
    "dataset": "Where the run publishes the dataset; default rollouts.jsonl in the output directory",
    "tuning": "diagnose-bottleneck and tune-parallelism",
}


async def _run_stage(given: dict[str, Any], tune_too: bool) -> dict[str, Any]:
    """A stage flow's body: its parameters merged with the served settings, run until done or stopped."""
    return await cancelled_by_sigterm(
        _stage(run_spec(given, RollflowSettings()).expanded(runtime_values()), tune_too)
    )


@flow(name="rollflow-diagnose", log_prints=False, flow_run_name=run_name)
@described(**STAGE_WORDING)
async def rollflow_diagnose(
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
) -> dict[str, Any]:
    """diagnose-bottleneck alone: the verdict, with its figures, in <output>/diagnosis.json.

    A field left out keeps its served value, as for rollflow-run.
    """
    return await _run_stage(locals(), tune_too=False)


@flow(name="rollflow-tune", log_prints=False, flow_run_name=run_name)
@described(**STAGE_WORDING)
async def rollflow_tune(
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
) -> dict[str, Any]:
    """diagnose-bottleneck then tune-parallelism: <output>/tuning.json and throughput.png.

    A field left out keeps its served value, as for rollflow-run.
    """
    return await _run_stage(locals(), tune_too=True)
