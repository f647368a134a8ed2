"""`rollflow reverify SOURCE --output OUT --verifier V`: rescore a published output, print the comparison."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson
from rich.table import Table

from rollflow.flows.cli.errors import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    UsageError,
    check_engine,
    known_errors_quiet,
    load_settings,
    print_error,
    print_failure,
    quiet_prefect,
    stderr_console,
    user_errors,
    validation_problems,
)


def add_reverify_parser(sub: Any, full: bool = True) -> None:
    """The reverify command; its settings flags (help, type, default from ReverifySpec and VerifySettings)
    only when `full`, so the other commands do not import the settings models for it."""
    p = sub.add_parser("reverify", help="rescore a published output with another verifier (no backend)")
    if not full:
        return
    from rollflow.flows.cli.flags import REVERIFY_FLAGS, add_flags

    p.add_argument("source", help="a published output folder or dataset file (local path or s3://...)")
    p.add_argument("--output", required=True, help="where the rescored dataset and its report go")
    add_flags(p, REVERIFY_FLAGS, "reverify")
    o = p.add_argument_group("display")
    o.add_argument("--no-progress", action="store_true", help="no progress lines")
    o.add_argument("--json", action="store_true", help="print report.json to stdout at the end")
    o.add_argument("--verbose", action="store_true", help="show Prefect's logs")


def build_reverify_spec(args: argparse.Namespace) -> Any:
    """The verifier and engine settings from env/.env (ROLLFLOW_VERIFY__*, ROLLFLOW_PIPELINE__RUNNER and the
    other engine settings), then the flags."""
    from pydantic import ValidationError

    from rollflow.flows.cli.flags import REVERIFY_FLAGS, given_flags, reverify_label
    from rollflow.settings.models import EngineSettings
    from rollflow.settings.reverify import ReverifySpec

    settings = load_settings()
    given = given_flags(args, (REVERIFY_FLAGS,))
    verify = {**settings.verify.model_dump(), **given.get("verify", {})}
    fields: dict[str, Any] = {"source": args.source, "output": args.output, "verify": verify}
    engine = set(EngineSettings.model_fields) & settings.pipeline.model_fields_set  # as `run` reads them
    fields.update(settings.pipeline.model_dump(include=engine))
    fields.update(given.get("reverify", {}))
    try:
        return ReverifySpec.model_validate(fields)
    except ValidationError as exc:
        problems = validation_problems(exc, reverify_label)
        raise UsageError(f"Invalid settings: {problems}.") from exc


def summary_table(report: dict[str, Any]) -> Table:
    from rollflow.tasks.collect.percentiles import shown

    table = Table(title="rollflow reverify", show_header=False, title_justify="left")
    table.add_column("metric", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    before, after = report.get("before") or {}, report.get("after") or {}

    def mean(d: dict[str, Any]) -> str:
        return "-" if d.get("mean") is None else f"{d['mean']:.4f}"

    rows = [
        ("dataset", report.get("dataset") or "not published"),
        ("verifier", report["verifier"]["name"]),
        ("rollouts written", f"{report['rows_written']:,}"),
        ("rescored", f"{report['rescored']:,}"),
        ("rewards changed", f"{report['changed']:,}"),
        ("failed", f"{report['failed']:,}"),
        ("reward mean", f"{mean(before)} -> {mean(after)}"),
        ("rows/s", shown(report["metrics"].get("rows_per_s"))),
        ("wall time", f"{report['metrics']['wall_s']:,.1f} s"),
        ("report", f"{report['output'].rstrip('/')}/report.md"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def started_line(spec: Any) -> str:
    """reverify's first progress line: what it reads, where it writes, what scores."""
    from rollflow.settings import redact

    return redact.redact(
        f"reverify started: source {spec.source}, output {spec.output}, verifier "
        f"{spec.verify.verifier_for('responses')}"
    )


def cmd_reverify(args: argparse.Namespace) -> int:
    spec = build_reverify_spec(args)
    check_engine(spec)
    quiet_prefect(args.verbose)
    console = stderr_console()
    progress = not args.no_progress
    lines = progress and not console.is_terminal
    if progress:  # at once: Prefect and the flow take seconds to load, the verifier processes to start
        console.print(f"rollflow: {started_line(spec)}", highlight=False, soft_wrap=True)
        console.print("rollflow: loading Prefect and the flow", highlight=False)
    from rollflow.flows.cli.prefect_api import command_api, using
    from rollflow.flows.cli.progress import Notes, ProgressBar, ProgressLines
    from rollflow.flows.reverify import ReverifyIncomplete, rollflow_reverify
    from rollflow.settings import RollflowSettings, redact

    api = command_api(args.started_at)
    known = user_errors()
    status = EXIT_OK
    try:
        redact.register(RollflowSettings())
        with (
            known_errors_quiet((*known, ReverifyIncomplete), args.verbose),
            Notes(console, stages=progress),
            ProgressBar(console, enabled=progress and console.is_terminal, verb="rescore"),
            ProgressLines(None, enabled=lines, verb="rescore"),
            using(api),
        ):
            if progress:
                console.print(f"rollflow: starting the flow (Prefect API: {api.source})", highlight=False)
            report = asyncio.run(rollflow_reverify(spec))
    except ReverifyIncomplete as exc:
        report, status = exc.report, EXIT_INCOMPLETE
        print_error(console, exc)
    except BaseException as exc:
        return print_failure(console, exc, known, "Committed chunks")
    finally:
        api.stop_ephemeral()
    console.print(summary_table(report))
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    return status
