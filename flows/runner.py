"""Running a flow from the CLI: progress bar, one-paragraph errors, a summary table, the exit status."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from flows.progress import ProgressBar
from settings import RunSpec

EXIT_OK, EXIT_INCOMPLETE, EXIT_ERROR = 0, 1, 2


def process_start() -> float:
    """When this process started (epoch seconds), read from /proc so interpreter start-up counts too."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()


def _user_errors() -> tuple[type[BaseException], ...]:
    from flows.secrets import SecretBlockError
    from tasks.diagnose import TuningError
    from tasks.lease import LeaseHeld, LeaseLost
    from tasks.ledger import IdentityMismatch
    from tasks.preflight import BackendUnreachable
    from tasks.rows import InputError
    from tasks.storage import StorageError
    from tasks.verifiers import VerifierError

    return (
        InputError,
        StorageError,
        IdentityMismatch,
        BackendUnreachable,
        VerifierError,
        SecretBlockError,
        LeaseHeld,
        LeaseLost,
        TuningError,
    )


class HideKnownErrors(logging.Filter):
    """Console only: drop Prefect's records of an expected error, which rollflow reports in one paragraph.

    Prefect logs a failed task or flow with its traceback, then its Failed state; the API handler (the
    Prefect UI) still gets both, and the run's state stays Failed with the message.
    """

    def __init__(self, known: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.known = known
        self.names = tuple(f"exception {t.__name__}: " for t in known)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            return not isinstance(record.exc_info[1], self.known)
        if not record.name.startswith("prefect"):
            return True
        message = record.getMessage().replace("exception: ", "exception ")
        return not any(name in message for name in self.names)


@contextmanager
def known_errors_quiet(known: tuple[type[BaseException], ...], verbose: bool) -> Iterator[None]:
    """Install HideKnownErrors on Prefect's console handlers (none with --verbose) while a flow runs."""
    from prefect.logging.handlers import PrefectConsoleHandler

    hide = HideKnownErrors(known)
    handlers = [] if verbose else logging.getLogger().handlers
    consoles = [h for h in handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(hide)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(hide)


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


async def _run_flow(spec: RunSpec, flow_name: str, started_at: float | None) -> dict[str, Any]:
    from flows.pipeline import rollflow_collect, rollflow_run

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
    from flows.pipeline import RunIncomplete

    console = Console(stderr=True)
    user_errors = _user_errors()
    report: dict[str, Any] | None = None
    status = EXIT_OK
    try:
        with (
            known_errors_quiet((*user_errors, RunIncomplete), verbose),
            ProgressBar(console, enabled=progress and console.is_terminal),
        ):
            report = asyncio.run(_run_flow(spec, flow_name, started_at))
    except RunIncomplete as exc:
        report, status = exc.report, EXIT_INCOMPLETE
        console.print(f"[bold red]rollflow:[/] {exc}", highlight=False, soft_wrap=True)
    except user_errors as exc:
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
            from flows.tuning import print_tuning

            print_tuning(console, report, report["output"])
        console.print(summary_table(report))
        if print_json:
            sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    return status
