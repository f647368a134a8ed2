"""Running a flow from the CLI: progress bar, one-paragraph errors, a summary table, the exit status."""

from __future__ import annotations

import asyncio
import atexit
import gc
import sys
import time
from datetime import datetime
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from rollflow.flows.cli.errors import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    known_errors_quiet,
    print_error,
    print_failure,
    stderr_console,
    styled,
    user_errors,
)
from rollflow.flows.cli.prefect_api import PrefectApi, using
from rollflow.flows.cli.progress import Notes, ProgressBar, ProgressLines
from rollflow.flows.cli.tuning_cmd import print_tuning
from rollflow.flows.parameters import COMMAND_STARTED
from rollflow.flows.pipeline import RunIncomplete, rollflow_collect, rollflow_run
from rollflow.settings import RollflowSettings, RunSpec, redact
from rollflow.tasks.collect.percentiles import shown
from rollflow.tasks.publish.amend import amend_report
from rollflow.tasks.publish.endpoints import AGENT_COLUMNS, ENDPOINTS_LEGEND, agent_cells, endpoint_cells
from rollflow.tasks.publish.rewards import summary_line
from rollflow.tasks.publish.story import story_line
from rollflow.tasks.storage.store import Store


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def summary_table(report: dict[str, Any]) -> Table:
    """Two columns that fit 80; a long URL folds onto the next lines instead of being cut."""
    table = Table(title="rollflow run", show_header=False, title_justify="left")
    table.add_column("metric", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = [
        ("dataset", report.get("dataset") or "not published"),
        ("rollouts expected", f"{report['rows_expected']:,}"),
        ("rollouts written", f"{report['rows_written']:,}"),
        ("failed", f"{report['failed']:,}"),
        ("duplicates", f"{report['duplicates']:,}"),
        ("missing", f"{report['missing']:,}"),
        *_settling_rows(report),
        ("reward mean", _num(report["reward_mean"], ".4f")),
        ("rollouts/s", _num(report["rollouts_per_s"], ",.1f")),
        ("output tokens/s", _num(report["output_tokens_per_s"], ",.0f")),
        ("collect rollouts/s", _num(report.get("collect_rollouts_per_s"), ",.1f")),
        ("parallelism", _parallelism(report)),
        ("wall time", _num(report["wall_s"], ",.1f", " s")),
        *((f"  {name}", _num(s, ",.1f", " s")) for name, s in (report.get("stages") or {}).items()),
        ("report", f"{report['output'].rstrip('/')}/report.json"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _settling_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """--settle-after and --until-learnable: what the rules left out, and the forecast's rollouts."""
    rows: list[tuple[str, str]] = []
    settling = report.get("settling")
    if settling:
        rows.append(("settled tasks", f"{settling['settled_tasks']:,} after {settling['settle_after']}"))
        rows.append(("not requested", f"{settling['rollouts_not_requested']:,} (settled, not missing)"))
    until = report.get("until_learnable")
    if until:
        if not until.get("reached", True):
            said = "not reached: the input ran out"
        else:
            said = "stopped" if until["chunks_not_needed"] else "reached; every chunk had started"
        rows.append(("until learnable", f"{until['learnable_tasks']:,} of {until['target']:,}; {said}"))
    forecast = report.get("forecast")
    if forecast and forecast.get("rollouts") is not None:
        rows.append(("forecast rollouts", f"{forecast['rollouts']:,}"))
    return rows


def agents_table(agents: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="agents", show_header=True)
    for i, column in enumerate(AGENT_COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for name, row in agents.items():
        table.add_row(*agent_cells(name, row))
    return table


def endpoints_table(report: dict[str, Any]) -> Table | None:
    """report.json's `endpoints` in 80 columns: a long URL folds, numbers stay whole; None without them."""
    rows = report.get("endpoints") or []
    if not rows:
        return None
    table = Table(
        title="endpoints",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        caption=ENDPOINTS_LEGEND,
        caption_justify="left",
    )
    table.add_column("endpoint", overflow="fold")
    for name in ("rollouts", "per s", "errors", "limit", "out s", "engine"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*endpoint_cells(row))
    return table


async def _run_flow(spec: RunSpec, flow_name: str, started_at: float | None) -> dict[str, Any]:
    flow = {"run": rollflow_run, "collect": rollflow_collect}[flow_name]
    COMMAND_STARTED.set(started_at)
    return await flow(**spec.parameters())


def finish(report: dict[str, Any], spec: RunSpec, api: PrefectApi) -> str | None:
    """Time the command's end (flow run finished, Prefect's logs and events sent, its ephemeral server
    stopped) from the report's creation, and add it and Prefect's whole-command share to the report.

    report.json gets them only if the output is still this run's; otherwise a note says so (returned).
    Only the interpreter's own exit, after this, is not counted.
    """
    api.stop_ephemeral()
    reported = datetime.fromisoformat(report["generated_at"]).timestamp()
    shutdown = max(0.0, (api.stopped_at or time.time()) - reported)
    whole = (report.get("wall_s") or 0.0) + shutdown
    prefect_s = max(0.0, report["before_flow_s"] - api.began_s) + report["chunk_task_overhead_s"] + shutdown
    updates = {
        "shutdown_s": round(shutdown, 3),
        "prefect_overhead_share": round(prefect_s / whole, 4) if whole > 0 else None,
        "prefect_api": api.source,
    }
    settings = RollflowSettings()
    output = report.get("output") or spec.output  # an output template is filled by the flow
    store = Store(output, settings.storage.storage_options(output))
    note = amend_report(store, report, updates, settings.pipeline.lease_ttl_s)
    report.update(updates)
    return note


def run_and_print(
    spec: RunSpec,
    flow_name: str,
    *,
    progress: bool,
    print_json: bool,
    verbose: bool = False,
    started_at: float | None = None,
    api: PrefectApi | None = None,
) -> int:
    """Run the flow and print its summary; `started_at` is the command's start, for the report's wall time."""
    console = stderr_console()
    known = user_errors()
    status = EXIT_OK
    api = api or PrefectApi(None, "ephemeral")
    # At exit, freezing the heap spares the interpreter a last collection of every module it loaded
    # (Prefect's server modules included): 1.7 s of this machine's exit, measured, down to 0.05 s.
    atexit.register(gc.freeze)
    try:
        redact.register(RollflowSettings())
        with (
            known_errors_quiet((*known, RunIncomplete), verbose),
            Notes(console),
            ProgressBar(console, enabled=progress and console.is_terminal),
            ProgressLines(spec, enabled=progress and not console.is_terminal),
            using(api),
        ):
            report = asyncio.run(_run_flow(spec, flow_name, started_at))
        note = finish(report, spec, api)
    except RunIncomplete as exc:
        report, status = exc.report, EXIT_INCOMPLETE
        note = finish(report, spec, api)
        print_error(console, exc)
    except BaseException as exc:
        return print_failure(console, exc, known, "Committed chunks and saved rollouts")
    _print_report(console, report, note, print_json)
    return status


def _print_report(console: Console, report: dict[str, Any], note: str | None, print_json: bool) -> None:
    """The note on the report's own file (if any), the tuning, the summary, rewards, endpoints, the JSON."""
    if note:
        console.print(styled("rollflow:", "yellow"), note, highlight=False, soft_wrap=True)
    for said in report.get("warnings") or []:  # NeMo Gym's warnings of routing, as its collector prints
        console.print(styled("rollflow: warning:", "yellow"), said, highlight=False, soft_wrap=True)
    for key in ("tuning_skipped", "tuning_stopped"):  # said where the chosen parallelism is printed
        if report.get(key):
            said = f"{key.replace('_', ' ')}: {report[key]}"
            console.print(styled("rollflow:", "yellow"), said, highlight=False, soft_wrap=True)
    if report.get("diagnosis"):
        print_tuning(console, report, report["output"])
    console.print(summary_table(report))
    if report.get("rewards"):
        console.print(summary_line(report["rewards"]), highlight=False, soft_wrap=True)
    if report.get("story"):
        console.print(story_line(report["story"]), highlight=False, soft_wrap=True)
    if report.get("agents"):
        console.print(agents_table(report["agents"]))
    endpoints = endpoints_table(report)
    if endpoints is not None:
        console.print(endpoints)
    if print_json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")


def _parallelism(report: dict[str, Any]) -> str:
    """The fixed or tuned value, or what set it while collecting: the engine's gauges or the latency rules."""
    control = report.get("adaptive") or {}
    if not control:
        return shown(report["parallelism"])
    how = "followed the engine's gauges" if control.get("mode") == "engine" else "followed latency and 429s"
    return f"{how}, ended at {shown(control.get('final_parallelism'))}"
