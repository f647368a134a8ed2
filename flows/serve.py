"""`rollflow serve`: the pipeline, diagnose and tune flows as deployments, with schedules and defaults.

Defaults for the run form come from settings (ROLLFLOW_* / .env); secrets never become parameters: a
served run reads API and S3 keys from the serving process's environment, like any other run.
"""

from __future__ import annotations

import argparse
from typing import Any

from settings import RollflowSettings, RunSpec

DEPLOYMENT = "rollflow"


def default_parameters(settings: RollflowSettings) -> dict[str, Any]:
    """A full spec when settings name input and output; otherwise none (the form then asks for them)."""
    fields = RunSpec.fields_from(settings)
    if not fields["input"] or not fields["output"]:
        return {}
    return {"spec": RunSpec.model_validate(fields).model_dump(mode="json")}


def deployments(args: argparse.Namespace, settings: RollflowSettings) -> list[Any]:
    from flows.pipeline import rollflow_run
    from flows.tuning import rollflow_diagnose, rollflow_tune

    params = default_parameters(settings)
    schedule: dict[str, Any] = {}
    if args.cron:
        schedule = {"cron": args.cron, "timezone": args.timezone}
    elif args.interval_s:
        schedule = {"interval": args.interval_s}
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
