"""A served run's parameters: what the run gave, merged field by field with the served settings.

Prefect merges a run's parameters with its deployment's one top-level key at a time, so the flows take
the spec as sections: a run that gives `collection={"limit": 4}` arrives with a CollectionSettings whose
only set field is `limit`, and every other field comes from the settings the flow process was served
with (ROLLFLOW_* and .env of `rollflow serve` or of the worker).

Prefect builds each flow's parameter form from its signature and docstring, so every flow keeps its own
signature; what a parameter means is written once, here, and `described` puts it in the docstrings.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import PurePosixPath
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from pydantic import BaseModel

from rollflow.settings import (
    BackendParams,
    CollectionSettings,
    RollflowSettings,
    RunSpec,
    TuningSettings,
    VerifySettings,
)
from rollflow.settings.models import EngineSettings
from rollflow.tasks.storage.ledger import IdentityMismatch

F = TypeVar("F", bound=Callable[..., Any])
# When the `rollflow` command began (epoch seconds), for the report's wall time: set by the CLI in its own
# process, never a flow parameter (the run form shows only what a user sets).
SCHEDULE_TIMEZONE_ENV = "ROLLFLOW_SCHEDULE_TIMEZONE"  # set by `rollflow serve` for the runs it serves
COMMAND_STARTED: ContextVar[float | None] = ContextVar("rollflow_command_started", default=None)

REQUIRED = ("input", "output")
# What each flow parameter means: the Prefect UI shows it under the field. The flows' docstrings take
# their Args section from here (`described`), so rollflow-run, -diagnose and -tune word a field alike.
PARAMETER_HELP = {
    "input": "Input JSONL of NeMo Gym rows: local path or s3://...",
    "output": "Output directory (ledger, reports): local path or s3://...",
    "dataset": "Where to publish the dataset; default rollouts.jsonl in the output directory",
    "format": "jsonl (one rollouts.jsonl) or parquet (sharded Parquet under <output>/data/)",
    "backend": "Where rollouts come from and how hard to try for each one",
    "collection": "How the input is planned into chunks and how many requests run at once",
    "verify": "How rewards are computed for backends that return none",
    "tuning": "diagnose-bottleneck and tune-parallelism (parallelism auto or adaptive)",
    "engine": "Where chunks run: this process, or a Dask or Ray cluster's workers",
    "restart": "Discard a different run's committed chunks and start over",
    "allow_incomplete": "Publish even if the audit found gaps",
    "keep_chunks": "Keep the chunk data objects after publishing (the dataset holds their bytes)",
    "deadline_s": "Stop cleanly after this many seconds; run again to resume",
}
# Section defaults with no field set: a run that leaves a section out runs it as served.
AS_SERVED_BACKEND, AS_SERVED_COLLECTION = BackendParams(), CollectionSettings()
AS_SERVED_VERIFY, AS_SERVED_TUNING, AS_SERVED_ENGINE = VerifySettings(), TuningSettings(), EngineSettings()


def described(**wording: str) -> Callable[[F], F]:
    """Decorator (under @flow, which reads the docstring): the function's docstring gets an Args section
    naming each of its parameters in order, worded as in PARAMETER_HELP unless `wording` says otherwise."""

    def add_args(fn: F) -> F:
        words = {**PARAMETER_HELP, **wording}
        lines = "\n".join(f"    {name}: {words[name]}" for name in inspect.signature(fn).parameters)
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:\n{lines}"
        return fn

    return add_args


def given_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """The values a run set: a section's explicitly set fields, a top-level value that is not None."""
    changes: dict[str, Any] = {}
    for key, value in parameters.items():
        if isinstance(value, BaseModel):
            fields = value.model_dump(include=value.model_fields_set)
            if fields:
                changes[key] = fields
        elif value is not None:
            changes[key] = value
    return changes


def served_fields(settings: RollflowSettings) -> dict[str, Any]:
    return RunSpec.fields_from(settings)


def run_spec(parameters: dict[str, Any], settings: RollflowSettings) -> RunSpec:
    """The spec in force: the served settings with what the run gave on top (refused if invalid)."""
    return RunSpec.merged(served_fields(settings), given_fields(parameters))


def changed_from_served(spec: RunSpec, settings: RollflowSettings) -> list[str]:
    """`section.field served -> this run's` for each value this run changed."""
    fields = served_fields(settings)
    served = RunSpec.merged(fields, {k: getattr(spec, k) for k in REQUIRED if not fields[k]})
    return served.differences(spec)


def refusal(exc: IdentityMismatch, spec: RunSpec, settings: RollflowSettings) -> IdentityMismatch:
    """The ledger's refusal, with the fields this run changed and what to do from Prefect."""
    changed = changed_from_served(spec, settings)
    said = f" This run changed from the served values: {'; '.join(changed)}." if changed else ""
    return IdentityMismatch(
        f"{exc}{said} From Prefect: give the run another `output`, or set `restart` to true to discard "
        "the committed chunks."
    )


def _zone() -> tzinfo:
    """The timezone `rollflow serve --timezone` set for the runs it serves; UTC elsewhere."""
    name = os.environ.get(SCHEDULE_TIMEZONE_ENV, "UTC")
    try:
        return UTC if name == "UTC" else ZoneInfo(name)
    except (ValueError, OSError):
        return UTC


def _started() -> datetime:
    """When the flow run was scheduled to start (its creation time for a run started at once), in the
    schedule's timezone: a 22:00 run in Los Angeles is dated that day, not tomorrow in UTC."""
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time
    return (when if isinstance(when, datetime) else datetime.now(UTC)).astimezone(_zone())


def deployment_name() -> str:
    """The run's deployment's name, "" when it has none. A top-level run's own flow run says so: Prefect's
    runtime.deployment would read the run back from the API first (a client, a TLS context and a request:
    ~0.1 s) each time; a subflow may be under a deployed parent, so it asks Prefect."""
    from prefect.context import FlowRunContext
    from prefect.runtime import deployment

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx is not None else None
    if run is not None and run.deployment_id is None and run.parent_task_run_id is None:
        return ""
    return deployment.name or ""


def runtime_values() -> dict[str, str]:
    """The values an output's placeholders take: the same on every retry of one flow run."""
    from prefect.runtime import flow_run

    when = _started()
    return {
        "date": when.strftime("%Y-%m-%d"),
        "datetime": when.strftime("%Y%m%dT%H%M%S")
        + ("Z" if when.utcoffset() == timedelta(0) else when.strftime("%z")),
        "flow_run_name": flow_run.name or "",
        "flow_run_id": str(flow_run.id or ""),
        "deployment": deployment_name(),
    }


def run_name() -> str:
    """A flow run's name from what it collects: `<input stem>-<model or kind>-<MMDD>-<HHMMSS>` (UTC), and
    its deployment's name when served (`rows-qwen3-1202-020000-nightly`), not Prefect's random words."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    stem = PurePosixPath(str(params.get("input") or "run").rstrip("/")).name.split(".")[0] or "run"
    backend = params.get("backend")
    backend = backend.model_dump() if isinstance(backend, BaseModel) else (backend or {})
    model = str(backend.get("model") or backend.get("kind") or "").rsplit("/", 1)[-1]
    parts = [stem, model, _started().strftime("%m%d-%H%M%S"), deployment_name()]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "-", p).strip("-") for p in parts if p)[:100]
