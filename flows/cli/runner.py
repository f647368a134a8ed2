"""Running a flow from the CLI: progress bar, one-paragraph errors, a summary table, the exit status."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from rollflow.flows.cli.errors import (
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_OK,
    known_errors_quiet,
    user_errors,
)
from rollflow.flows.cli.progress import ProgressBar
from rollflow.flows.cli.tuning_cmd import print_tuning
from rollflow.flows.pipeline import RunIncomplete, rollflow_collect, rollflow_run
from rollflow.settings import RunSpec
from rollflow.tasks.publish.endpoints import endpoint_cells


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
        ("reward mean", _num(report["reward_mean"], ".4f")),
        ("rollouts/s", _num(report["rollouts_per_s"], ",.1f")),
        ("output tokens/s", _num(report["output_tokens_per_s"], ",.0f")),
        ("collect rollouts/s", _num(report.get("collect_rollouts_per_s"), ",.1f")),
        ("parallelism", str(report["parallelism"])),
        ("wall time", _num(report["wall_s"], ",.1f", " s")),
        *((f"  {name}", _num(s, ",.1f", " s")) for name, s in (report.get("stages") or {}).items()),
        ("report", f"{report['output'].rstrip('/')}/report.json"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def endpoints_table(report: dict[str, Any]) -> Table | None:
    """report.json's `endpoints` in 80 columns: a long URL folds, numbers stay whole; None without them."""
    rows = report.get("endpoints") or []
    if not rows:
        return None
    table = Table(title="endpoints", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("endpoint", overflow="fold")
    for name in ("rollouts", "per s", "errors", "limit", "out s", "engine"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*endpoint_cells(row))
    return table


async def _run_flow(spec: RunSpec, flow_name: str, started_at: float | None) -> dict[str, Any]:
    flow = {"run": rollflow_run, "collect": rollflow_collect}[flow_name]
    return await flow(spec, started_at=started_at)


def run_and_print(
    spec: RunSpec,
    flow_name: str,
    *,
    progress: bool,
    print_json: bool,
    verbose: bool = False,
    started_at: float | None = None,
) -> int:
    """Run the flow and print its summary; `started_at` is the command's start, for the report's wall time."""
    console = Console(stderr=True)
    known = user_errors()
    report: dict[str, Any] | None = None
    status = EXIT_OK
    try:
        with (
            known_errors_quiet((*known, RunIncomplete), verbose),
            ProgressBar(console, enabled=progress and console.is_terminal),
        ):
            report = asyncio.run(_run_flow(spec, flow_name, started_at))
    except RunIncomplete as exc:
        report, status = exc.report, EXIT_INCOMPLETE
        console.print(f"[bold red]rollflow:[/] {exc}", highlight=False, soft_wrap=True)
    except known as exc:
        console.print(f"[bold red]rollflow:[/] {exc}", highlight=False, soft_wrap=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        console.print(
            "[bold yellow]rollflow:[/] interrupted. Committed chunks are kept; run the same command again "
            "to resume."
        )
        return 130
    if report is not None:
        if report.get("diagnosis"):
            print_tuning(console, report, report["output"])
        console.print(summary_table(report))
        endpoints = endpoints_table(report)
        if endpoints is not None:
            console.print(endpoints)
        if print_json:
            sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    return status
