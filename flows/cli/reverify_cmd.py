"""`rollflow reverify SOURCE --output OUT --verifier V`: rescore a published output, print the comparison."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson
from rich.console import Console
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
    user_errors,
    validation_problems,
)


def add_reverify_parser(sub: Any) -> None:
    p = sub.add_parser("reverify", help="rescore a published output with another verifier (no backend)")
    p.add_argument("source", help="a published output folder or dataset file (local path or s3://...)")
    p.add_argument("--output", required=True, help="where the rescored dataset and its report go")
    p.add_argument("--verifier", help="exact_match, math, math_fast, http or module:function")
    p.add_argument("--verifier-url", help="resources server for --verifier http")
    p.add_argument("--verify-processes", type=int, help="processes for math and module:function checks")
    p.add_argument("--verify-timeout-s", type=float, help="longest one check may run")
    p.add_argument("--correct-threshold", type=float, help="a rollout is correct at reward >= this")
    p.add_argument("--failed-only", action="store_true", help="rescore only the source's failed checks")
    p.add_argument("--format", choices=("jsonl", "parquet"), help="dataset format (default jsonl)")
    p.add_argument("--chunk-size", type=int, help="rollouts per chunk task (default 10000)")
    p.add_argument("--parallelism", type=int, help="checks in flight at once (default 64)")
    p.add_argument("--chunks-in-flight", type=int, help="chunk tasks at once (default 2)")
    p.add_argument(
        "--runner",
        choices=("local", "dask", "ray"),
        help="local (default), dask or ray: chunks on the cluster's worker processes",
    )
    p.add_argument("--dask-address", help="the Dask scheduler to send chunks to (default: a local cluster)")
    p.add_argument("--dask-workers", type=int, help="processes of the local Dask cluster (default 2)")
    p.add_argument("--ray-address", help="the Ray cluster to send chunks to (default: a local instance)")
    p.add_argument(
        "--ray-keep-workers-s",
        type=float,
        help="keep Ray chunk workers this long after their last chunk, for the next run (default 0)",
    )
    p.add_argument("--restart", action="store_true", help="discard a different reverify in OUT")
    p.add_argument("--allow-incomplete", action="store_true", help="publish even if some checks failed")
    p.add_argument("--keep-chunks", action="store_true", help="keep the chunk data objects after publishing")
    p.add_argument("--json", action="store_true", help="print report.json to stdout at the end")
    p.add_argument("--verbose", action="store_true", help="show Prefect's logs")


VERIFY_FLAGS = {
    "verifier": "verifier",
    "verifier_url": "url",
    "verify_processes": "processes",
    "verify_timeout_s": "check_timeout_s",
    "correct_threshold": "correct_threshold",
}
TOP_FLAGS = (
    "format",
    "chunk_size",
    "parallelism",
    "chunks_in_flight",
    "runner",
    "dask_address",
    "dask_workers",
    "ray_address",
    "ray_keep_workers_s",
)


def _reverify_label(loc: list[str]) -> str:
    """A reverify settings error's location as its flag, else its dotted path."""
    if loc[:1] == ["verify"] and len(loc) == 2 and loc[1] in VERIFY_FLAGS.values():
        return "--" + next(f for f, v in VERIFY_FLAGS.items() if v == loc[1]).replace("_", "-")
    if len(loc) == 1 and loc[0] in TOP_FLAGS:
        return "--" + loc[0].replace("_", "-")
    return ".".join(loc)


def build_reverify_spec(args: argparse.Namespace) -> Any:
    """The verifier and engine settings from env/.env (ROLLFLOW_VERIFY__*, ROLLFLOW_PIPELINE__RUNNER and the
    other engine settings), then the flags."""
    from pydantic import ValidationError

    from rollflow.settings.models import EngineSettings
    from rollflow.settings.reverify import ReverifySpec

    settings = load_settings()
    verify = settings.verify.model_dump()
    verify.update(
        {
            field: getattr(args, flag)
            for flag, field in VERIFY_FLAGS.items()
            if getattr(args, flag) is not None
        }
    )
    fields: dict[str, Any] = {"source": args.source, "output": args.output, "verify": verify}
    engine = set(EngineSettings.model_fields) & settings.pipeline.model_fields_set  # as `run` reads them
    fields.update(settings.pipeline.model_dump(include=engine))
    fields.update({k: getattr(args, k) for k in TOP_FLAGS if getattr(args, k) is not None})
    fields.update(
        failed_only=args.failed_only,
        restart=args.restart,
        allow_incomplete=args.allow_incomplete,
        keep_chunks=args.keep_chunks,
    )
    try:
        return ReverifySpec.model_validate(fields)
    except ValidationError as exc:
        problems = validation_problems(exc, _reverify_label)
        raise UsageError(f"Invalid settings: {problems}.") from exc


def summary_table(report: dict[str, Any]) -> Table:
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
        ("rows/s", str(report["metrics"].get("rows_per_s") or "-")),
        ("wall time", f"{report['metrics']['wall_s']:,.1f} s"),
        ("report", f"{report['output'].rstrip('/')}/report.md"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def cmd_reverify(args: argparse.Namespace) -> int:
    spec = build_reverify_spec(args)
    check_engine(spec)
    quiet_prefect(args.verbose)
    from rollflow.flows.cli.prefect_api import command_api, using
    from rollflow.flows.reverify import ReverifyIncomplete, rollflow_reverify
    from rollflow.settings import RollflowSettings, redact

    api = command_api(args.started_at)
    console = Console(stderr=True)
    known = user_errors()
    status = EXIT_OK
    try:
        redact.register(RollflowSettings())
        with known_errors_quiet((*known, ReverifyIncomplete), args.verbose), using(api):
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
