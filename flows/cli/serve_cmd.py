"""`rollflow serve`: its flags and schedule options, then the flows served as deployments."""

from __future__ import annotations

import argparse
from typing import Any

from rollflow.flows.cli.errors import UsageError, load_settings

DEPLOYMENT = "rollflow"  # the deployments' default name (flows.serve, loaded with Prefect only to serve)


def schedule_of(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    """to_deployment's schedule keywords; a schedule needs input and output among the defaults."""
    if not (args.cron or args.interval_s):
        return {}
    missing = [k for k in ("input", "output") if k not in params]
    if missing:
        names = " and ".join(f"ROLLFLOW_PIPELINE__{k.upper()}" for k in missing)
        raise UsageError(
            f"A scheduled run needs its {' and '.join(missing)}: set {names} for rollflow serve."
        )
    if args.cron:
        return {"cron": args.cron, "timezone": args.timezone}
    return {"interval": args.interval_s}


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

    from rollflow.flows.serve import default_parameters, deployments
    from rollflow.settings import redact

    settings = load_settings()
    redact.register(settings)  # Prefect logs a run's parameters when they fail validation, before its flow
    params = default_parameters(settings)
    schedule = schedule_of(args, params)
    serve(*deployments(args.name, params, schedule), pause_on_shutdown=False, limit=args.limit)
    return 0
