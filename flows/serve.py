"""`rollflow serve`: the pipeline, diagnose and tune flows as deployments, with schedules and defaults.

Defaults for the run form come from settings (ROLLFLOW_* / .env); secrets never become parameters: a
served run reads API and S3 keys from the serving process's environment, like any other run.
"""

from __future__ import annotations

import argparse
from typing import Any

from rollflow.settings import RollflowSettings, RunSpec

DEPLOYMENT = "rollflow"


def default_parameters(settings: RollflowSettings) -> dict[str, Any]:
    """The spec's defaults from settings, for the run form and for scheduled runs.

    Without input or output in settings the spec is partial: Prefect accepts a deployment default that
    lacks required fields, and the form then asks for them while showing the other defaults filled in.
    """
    fields = RunSpec.fields_from(settings)
    placeholders = {"input": fields["input"] or "-", "output": fields["output"] or "-"}
    spec = RunSpec.model_validate({**fields, **placeholders}).model_dump(mode="json")
    for key in ("input", "output"):
        if not fields[key]:
            del spec[key]
    return {"spec": spec}


def schedule_of(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    """to_deployment's schedule keywords; a schedule needs input and output among the defaults."""
    if not (args.cron or args.interval_s):
        return {}
    from rollflow.flows.cli.main import UsageError

    missing = [k for k in ("input", "output") if k not in params["spec"]]
    if missing:
        names = " and ".join(f"ROLLFLOW_PIPELINE__{k.upper()}" for k in missing)
        raise UsageError(
            f"A scheduled run needs its {' and '.join(missing)}: set {names} for rollflow serve."
        )
    if args.cron:
        return {"cron": args.cron, "timezone": args.timezone}
    return {"interval": args.interval_s}


def deployments(args: argparse.Namespace, settings: RollflowSettings) -> list[Any]:
    from rollflow.flows.pipeline import rollflow_run
    from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune

    params = default_parameters(settings)
    schedule = schedule_of(args, params)
    tags = ["rollflow"]
    return [
        rollflow_run.to_deployment(
            name=args.name, parameters=params, tags=tags, description="diagnose, tune, collect, publish",
            **schedule,
        ),
        rollflow_diagnose.to_deployment(name=args.name, parameters=params, tags=tags),
        rollflow_tune.to_deployment(name=args.name, parameters=params, tags=tags),
    ]  # fmt: skip


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the flows as Prefect deployments (UI button, schedules)")
    p.add_argument("--name", default=DEPLOYMENT, help="deployment name (default rollflow)")
    p.add_argument("--cron", help='schedule rollflow-run, e.g. "0 2 * * *" for 02:00 nightly')
    p.add_argument("--timezone", default="UTC", help="timezone of --cron (default UTC)")
    p.add_argument("--interval-s", type=float, help="schedule rollflow-run every N seconds instead")
    p.add_argument("--limit", type=int, default=4, help="flow runs at once in this process")
    p.add_argument("--verbose", action="store_true")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; schedules stay as set (not paused) when serving stops."""
    from prefect import serve

    serve(*deployments(args, RollflowSettings()), pause_on_shutdown=False, limit=args.limit)
    return 0
