"""`rollflow diagnose` and `rollflow tune`: their flags, the run of the flow, and the tuning table."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

import orjson
from rich import box
from rich.console import Console
from rich.table import Table

from rollflow.flows.cli.errors import (
    EXIT_OK,
    known_errors_quiet,
    print_failure,
    quiet_prefect,
    stderr_console,
    styled,
    user_errors,
)

if TYPE_CHECKING:
    from rollflow.settings import RunSpec


def _cell(value: Any) -> str:
    """A table cell as every summary writes a value (`shown`): thousands separators, `-` for none."""
    from rollflow.tasks.collect.percentiles import shown

    return shown(value)


def print_tuning(console: Console, found: dict[str, Any], output: str) -> None:
    """The verdict, its next step and the tuning table, as the CLI shows them."""
    from rollflow.tasks.publish.plot import evidence_said, probe_fate, tuning_parts

    d = found["diagnosis"]
    console.print(styled(f"{d['verdict']}:", "bold"), d["reason"], highlight=False)
    console.print(f"next step: {d['next_step']}", highlight=False)
    if "tuning" in found:
        t = found["tuning"]
        for url, part in tuning_parts(t):
            console.print(_steps(part, "tune-parallelism" + (f" {url}" if url else "")))
            if url:
                console.print(
                    f"{url}: knee {part['knee']}, chosen {part['chosen_parallelism']}: {evidence_said(part)}",
                    highlight=False,
                )
            else:
                console.print(f"at the chosen level: {evidence_said(part)}", highlight=False)
        console.print(
            f"knee {t['knee']}, chosen parallelism {t['chosen_parallelism']} "
            f"{'in all ' if len(tuning_parts(t)) > 1 else ''}"
            + (f"({t['choice_rule']}; " if t.get("choice_rule") else "(")
            + f"{t['total_probe_rollouts']:,} probe rollouts, {probe_fate(t)}); "
            f"plot: {output.rstrip('/')}/throughput.png",
            highlight=False,
        )
        for _, part in tuning_parts(t):  # what squared the choice with the verdict, or why it could not
            for note in part.get("notes") or ():
                console.print(f"note: {note}", highlight=False)


def _steps(tuning: dict[str, Any], title: str) -> Table:
    from rollflow.tasks.publish.plot import steps_table

    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
        padding=(0, 1, 0, 0), pad_edge=False,
    )  # fmt: skip
    for col in ("phase", "in flight", "rollouts/s", "p50 ms", "p95 ms", "errors", "rollouts", "note"):
        table.add_column(col, justify="left" if col in ("phase", "note") else "right", overflow="fold")
    for row in steps_table(tuning):  # each rate's error is in report.md; the chosen level's is said below
        table.add_row(*(_cell(v) for k, v in row.items() if k != "±"))
    return table


def _run(args: argparse.Namespace, spec: RunSpec, tune_too: bool) -> int:
    """The stage's tuning settings come from the spec, so flags, env and .env apply as for `run`."""
    verbose = getattr(args, "verbose", False)
    quiet_prefect(verbose)
    from rollflow.flows.cli.prefect_api import command_api, using

    api = command_api(args.started_at)
    from rollflow.flows.engines import engine_fields_set, flag
    from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune

    if ignored := engine_fields_set(spec):
        flags = ", ".join(f"--{flag(name)}" for name in ignored)
        print(
            f"rollflow: {args.command} probes the backend from this process; it ignores {flags}",
            file=sys.stderr,
        )

    console = stderr_console()
    flow_fn = rollflow_tune if tune_too else rollflow_diagnose
    known = user_errors()
    try:
        with known_errors_quiet(known, verbose), using(api):
            params = spec.parameters()
            found = asyncio.run(flow_fn(**{k: params[k] for k in flow_fn.parameters.properties}))
    except BaseException as exc:
        return print_failure(console, exc, known, "The probes' saved rollouts")
    print_tuning(console, found, spec.output)
    if getattr(args, "json", False):
        print(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
    return EXIT_OK


def cmd_diagnose(args: argparse.Namespace, spec: RunSpec) -> int:
    """`rollflow diagnose`: the verdict and its next step."""
    return _run(args, spec, tune_too=False)


def cmd_tune(args: argparse.Namespace, spec: RunSpec) -> int:
    """`rollflow tune`: diagnosis, then the tuning table and the chosen parallelism."""
    return _run(args, spec, tune_too=True)
