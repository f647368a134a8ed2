"""`rollflow serve`: its flags and schedule options, then the flows served as deployments."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rollflow.flows.cli.errors import Terminated, UsageError, load_settings

DEPLOYMENT = "rollflow"  # the deployments' default name (flows.serve, loaded with Prefect only to serve)
MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 366 * 24 * 3600.0


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

    if args.cron is not None and args.interval_s is not None:
        raise UsageError("--cron and --interval-s exclude each other: give one schedule.")
    _check_timezone(args.timezone)
    if args.cron is not None:
        _check_cron(args.cron, args.timezone)
        return {"schedules": [Cron(args.cron, timezone=args.timezone)]}
    seconds = args.interval_s
    if not math.isfinite(seconds) or not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise UsageError(
            f"--interval-s must be a number of seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:,.0f} (a "
            f"year), not {seconds:g}: a shorter one floods the Prefect server with runs."
        )
    return {"schedules": [Interval(timedelta(seconds=seconds), timezone=args.timezone)]}


def _check_timezone(timezone: str) -> None:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(
            f"--timezone {timezone!r} is not a timezone name; give an IANA name such as UTC or Europe/Paris."
        ) from None


def _check_cron(expression: str, timezone: str) -> None:
    """Prefect's own check of the expression (five fields; six or seven with seconds and years)."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        if not expression.strip():
            raise ValueError("empty")
        CronSchedule(cron=expression, timezone=timezone)
    except (ValidationError, ValueError, TypeError):
        raise UsageError(
            f"--cron {expression!r} is not a cron expression Prefect takes; give five fields, e.g. "
            '"0 2 * * *" for 02:00 daily.'
        ) from None
    _check_fires(expression)


def _check_fires(expression: str) -> None:
    """A valid expression may name no date at all (`0 2 30 2 *`, 30 February): served, it never runs."""
    from prefect._vendor.croniter import CroniterBadDateError, croniter

    try:
        croniter(expression, datetime.now(UTC), max_years_between_matches=8).get_next(datetime)
    except CroniterBadDateError:
        raise UsageError(
            f"--cron {expression!r} names no date in the next 8 years (such as 30 February), so the "
            "schedule would never run. Check the day of month and the month."
        ) from None


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the flows as Prefect deployments (UI button, schedules)")
    p.add_argument("--name", default=DEPLOYMENT, help="deployment name (default %(default)s)")
    p.add_argument("--cron", help='schedule rollflow-run, e.g. "0 2 * * *" for 02:00 nightly')
    p.add_argument("--timezone", default="UTC", help="timezone of the schedule (default %(default)s)")
    p.add_argument("--interval-s", type=float, help="schedule rollflow-run every N seconds instead")
    p.add_argument(
        "--limit", type=int, default=4, help="flow runs at once in this process (default %(default)s)"
    )
    p.add_argument("--verbose", action="store_true")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; schedules stay as set (not paused) when serving stops."""
    from pydantic import ValidationError

    from rollflow.flows.cli.errors import validation_problems
    from rollflow.flows.cli.flags import flag_label
    from rollflow.flows.parameters import SCHEDULE_TIMEZONE_ENV
    from rollflow.flows.serve import default_parameters, deployments
    from rollflow.settings import redact

    settings = load_settings()
    redact.register(settings)  # Prefect logs a run's parameters when they fail validation, before its flow
    try:
        params = default_parameters(settings)
    except ValidationError as exc:
        raise UsageError(
            f"The served settings are invalid: {validation_problems(exc, flag_label)}."
        ) from None
    schedule = schedule_of(args, params)
    # The runs this process serves fill {date} and {datetime} in the schedule's timezone (they inherit it).
    os.environ[SCHEDULE_TIMEZONE_ENV] = args.timezone
    served = deployments(args.name, params, schedule)
    since = datetime.now(UTC)
    try:
        _serve_until_stopped(served, args.limit)
    finally:
        _end_abandoned_runs({d.flow_name for d in served}, {d.name for d in served}, since)
    return 0


CHILD_STOP_S = 20.0  # after Ctrl-C, how long a served run's process has to stop before it is terminated
CHILD_TERM_S = 10.0  # then how long SIGTERM has before SIGKILL


def _serve_until_stopped(served: list[Any], limit: int) -> None:
    """Prefect's serve, whose stop is bounded. Prefect waits for every run process it started, so one that
    does not stop would hold serve for as long as it runs, and its own SIGTERM handler exits without
    stopping them. After Ctrl-C (which a terminal sends to the runs too) they get CHILD_STOP_S to stop;
    SIGTERM (sent to serve alone, as systemd, Kubernetes or kill do) is passed on to them at once; then
    SIGKILL after CHILD_TERM_S. Either way the runs end Crashed or Cancelled, not Running."""
    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    from rollflow.flows.stops import RECANCEL_S

    stopped_by: list[str] = []

    async def main() -> None:
        serving = asyncio.current_task()
        assert serving is not None
        loop = asyncio.get_running_loop()

        def stop(name: str, grace_s: float) -> None:
            if not stopped_by:
                stopped_by.append(name)
                threading.Thread(target=_end_run_processes, args=(name, grace_s), daemon=True).start()
            recancel()

        def recancel() -> None:  # one cancellation can be lost (see flows.stops): until serving ends
            if not serving.done():
                serving.cancel()
                loop.call_later(RECANCEL_S, recancel)

        class BoundedRunner(Runner):
            def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:  # instead of exiting at once
                with contextlib.suppress(RuntimeError):  # the loop closed: serving has already stopped
                    loop.call_soon_threadsafe(stop, "SIGTERM", 0.0)

        loop.add_signal_handler(signal.SIGINT, stop, "Ctrl-C", CHILD_STOP_S)
        runner = BoundedRunner(pause_on_shutdown=False, limit=limit)
        for deployment in served:
            await runner.add_deployment(deployment)
        names = ", ".join(f"{d.flow_name}/{d.name}" for d in served)
        print(f"rollflow serve: serving {names}; Ctrl-C or SIGTERM stops it.", file=sys.stderr, flush=True)
        await runner.start()

    try:
        asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt, TerminationSignal) as exc:
        print(
            f"rollflow serve: stopped ({stopped_by[0] if stopped_by else _stop_name(exc)}).", file=sys.stderr
        )


def _stop_name(exc: BaseException) -> str:
    if type(exc).__name__ == "TerminationSignal" or isinstance(exc, Terminated):
        return "SIGTERM"
    return "Ctrl-C"


def _end_run_processes(stop: str, grace_s: float) -> None:
    """The flow-run processes this serve started that outlive `grace_s`, terminated, then killed."""
    deadline = time.monotonic() + grace_s
    while (left := _run_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for sig, wait_s in ((signal.SIGTERM, CHILD_TERM_S), (signal.SIGKILL, 0.0)):
        left = _run_processes()
        if not left:
            return
        print(
            f"rollflow serve: {len(left)} run process(es) still running after {stop}; sending "
            f"{sig.name} to {', '.join(map(str, left))}",
            file=sys.stderr,
        )
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _run_processes() and time.monotonic() < deadline:
            time.sleep(0.2)


def _run_processes() -> list[int]:
    """This process's children that run a flow (`python -m prefect.engine`), read from /proc."""
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == me and b"prefect.engine" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


ABANDONED = (
    "rollflow serve stopped while this run ran, and its process with it. Run it again with the same "
    "parameters: it resumes from the chunks it committed."
)


def _end_abandoned_runs(flows: set[str], names: set[str], since: datetime, within_s: float = 10.0) -> None:
    """The runs this process started and left RUNNING or PENDING when it stopped (Ctrl-C ends their
    processes with it) are marked CRASHED, saying why, instead of showing as running for ever; bounded,
    so a slow API never holds the stop. A second Ctrl-C or SIGTERM meanwhile (a double Ctrl-C, a
    supervisor's repeat) waits for the marking: it left the runs Running, with a traceback."""
    marking = threading.Thread(target=_mark_abandoned, args=(flows, names, since), daemon=True)
    marking.start()
    with _signals_held(f"rollflow serve: marking the runs it left (at most {within_s:g} s)"):
        marking.join(within_s)
    if marking.is_alive():
        print(
            f"rollflow: the runs this serve left running were not marked within {within_s:g} s",
            file=sys.stderr,
        )


@contextlib.contextmanager
def _signals_held(said: str) -> Iterator[None]:
    """SIGINT and SIGTERM say `said` (once) and are otherwise ignored for the block, then the handlers
    before it come back: Prefect's runner and the event loop leave handlers that need a loop no longer
    running."""
    told: list[bool] = []

    def hold(signum: int, frame: Any) -> None:
        if not told:
            told.append(True)
            print(said, file=sys.stderr, flush=True)

    before = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _mark_abandoned(flows: set[str], names: set[str], since: datetime) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(  # one call: this serve's deployments' runs still going
                flow_filter=FlowFilter(name=FlowFilterName(any_=sorted(flows))),
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=sorted(names))),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(
                        type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
                    ),
                    start_time=FlowRunFilterStartTime(after_=since),
                ),
            )
            for run in runs:
                client.set_flow_run_state(run.id, Crashed(message=ABANDONED), force=True)
    except Exception as exc:
        said = f"rollflow: could not mark the runs this serve left running ({type(exc).__name__})"
        print(said, file=sys.stderr)
