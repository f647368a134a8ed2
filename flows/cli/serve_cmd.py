"""`rollflow serve`: its flags and schedule options, then the flows served as deployments."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from rollflow.flows.cli.errors import UsageError, load_settings

DEPLOYMENT = "rollflow"  # the deployments' default name (flows.serve, loaded with Prefect only to serve)


def schedule_of(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    """to_deployment's `schedules`: a Cron (with its timezone) or an Interval; a schedule needs input and
    output among the defaults, and a bad cron expression or timezone is one usage error."""
    if args.cron is None and args.interval_s is None:
        return {}
    missing = [k for k in ("input", "output") if k not in params]
    if missing:
        names = " and ".join(f"ROLLFLOW_PIPELINE__{k.upper()}" for k in missing)
        raise UsageError(
            f"A scheduled run needs its {' and '.join(missing)}: set {names} for rollflow serve."
        )
    from prefect.schedules import Cron, Interval

    if args.cron:
        _check_cron(args.cron, args.timezone)
        return {"schedules": [Cron(args.cron, timezone=args.timezone)]}
    if args.interval_s <= 0:
        raise UsageError(f"--interval-s must be a positive number of seconds, not {args.interval_s:g}.")
    return {"schedules": [Interval(timedelta(seconds=args.interval_s), timezone=args.timezone)]}


def _check_cron(expression: str, timezone: str) -> None:
    """Prefect's own checks of the expression and the timezone, as one usage error each."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(
            f"--timezone {timezone!r} is not a timezone name; give an IANA name such as UTC or Europe/Paris."
        ) from None
    try:
        CronSchedule(cron=expression, timezone=timezone)
    except ValidationError:
        raise UsageError(
            f"--cron {expression!r} is not a cron expression Prefect takes; give five fields, e.g. "
            '"0 2 * * *" for 02:00 daily.'
        ) from None


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the flows as Prefect deployments (UI button, schedules)")
    p.add_argument("--name", default=DEPLOYMENT, help="deployment name (default rollflow)")
    p.add_argument("--cron", help='schedule rollflow-run, e.g. "0 2 * * *" for 02:00 nightly')
    p.add_argument("--timezone", default="UTC", help="timezone of the schedule (default UTC)")
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
