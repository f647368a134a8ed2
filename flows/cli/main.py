"""The `rollflow` command: run, collect, diagnose, tune, reverify, serve, simulate, demo.

Each command imports its module when it runs, so `rollflow simulate` starts without loading Prefect.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from rollflow.flows.cli.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Terminated,
    UsageError,
    check_engine,
    load_settings,
    quiet_prefect,
    terminate_like_ctrl_c,
    validation_problems,
)

if TYPE_CHECKING:
    from rollflow.settings import RollflowSettings


def _add_run_flags(p: argparse.ArgumentParser, command: str, tuning: bool = False) -> None:
    from rollflow.flows.cli.flags import RUN_FLAGS, TUNING_FLAGS, add_flags

    add_flags(p, RUN_FLAGS, command)
    if tuning:
        add_flags(p, TUNING_FLAGS, command)
    o = p.add_argument_group("display")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    o.add_argument("--json", action="store_true", help="print report.json to stdout at the end")
    o.add_argument("--verbose", action="store_true", help="show Prefect's logs")


def command_defaults(
    settings: RollflowSettings, defaults: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The command's own defaults (e.g. `run`'s parallelism auto) for fields no env var or .env set.

    pydantic-settings records in each group's `model_fields_set` what a source gave, so .env counts
    exactly like the environment and neither is overridden by a default.
    """
    return {
        group: {k: v for k, v in fields.items() if k not in getattr(settings, group).model_fields_set}
        for group, fields in defaults.items()
    }


def build_spec(
    args: argparse.Namespace, extra: list[str], defaults: dict[str, dict[str, Any]] | None = None
) -> Any:
    """Defaults, then .env, then env, then NeMo Gym `+key=value`, then flags: the last one given wins."""

    settings = load_settings()
    groups = _setting_groups(settings)
    for group, fields in command_defaults(settings, defaults or {}).items():
        groups[group].update(fields)
    _apply_nemo_gym(extra, groups, args)
    from rollflow.flows.cli.flags import RUN_FLAGS, TUNING_FLAGS, given_flags

    flags = given_flags(args, (RUN_FLAGS, TUNING_FLAGS))
    flags.get("collection", {}).pop("overrides", None)
    for group, fields in flags.items():
        groups[group].update(fields)
    _dataset_file_output(groups, flags)
    _head_server_default(settings, groups, flags)
    if getattr(args, "overrides", None):
        collection = groups["collection"]
        collection["overrides"] = {**collection["overrides"], **_json_overrides(args.overrides)}
    spec = _validated_spec(groups)
    say_url_notes()
    return spec


def say_url_notes() -> None:
    """What the settings did to a backend URL (a `/v1` taken off), said once, before the run."""
    from rollflow.settings import redact
    from rollflow.settings.models import url_notes

    for note in url_notes():
        print(f"rollflow: {redact.redact(note)}", file=sys.stderr)


def command_spec(command: str, args: argparse.Namespace, extra: list[str]) -> Any:
    """The spec `command` (run, collect, diagnose, tune) runs: its own defaults (COMMAND_DEFAULTS, which its
    --help states), then the sources, then its flags."""
    from rollflow.flows.cli.flags import COMMAND_DEFAULTS

    return build_spec(args, extra, COMMAND_DEFAULTS.get(command))


def _setting_groups(settings: Any) -> dict[str, dict[str, Any]]:
    """The run's fields by group ("" for the top-level ones), from settings, for the sources to update."""
    from rollflow.settings import RunSpec

    top = RunSpec.fields_from(settings)
    groups = {group: top.pop(group) for group in ("backend", "collection", "verify", "tuning")}
    return {"": top, **groups}


def _apply_nemo_gym(extra: list[str], groups: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """NeMo Gym's `+key=value` arguments and `gym eval run` flags mean an agent backend."""
    from rollflow.flows.cli.nemo_gym import apply_nemo_gym, overrides_of

    found = overrides_of(extra, args)
    short = {"input": getattr(args, "ng_input", None), "output": getattr(args, "ng_output", None)}
    if apply_nemo_gym(found, groups) or any(short.values()):
        groups["backend"]["kind"] = "agent"
    top = groups[""]
    if short["input"]:
        top["input"] = short["input"]
    if short["output"]:  # -o names the dataset file, as NeMo Gym writes it; -o dir/ names the output folder
        out = short["output"]
        if out.endswith("/") or os.path.isdir(out):
            top["output"] = out
        elif not top.get("dataset"):
            top["dataset"], top["output"] = out, out + ".rollflow"
    dataset = top.get("dataset")
    if found.get("output_jsonl_fpath") and dataset and not args.output:
        top["output"] = dataset + ".rollflow"


def _dataset_file_output(groups: dict[str, dict[str, Any]], given: dict[str, dict[str, Any]]) -> None:
    """`--output x.jsonl` names the dataset file, as NeMo Gym's `-o` does; rollflow's files go beside."""
    top = groups[""]
    output = given.get("", {}).get("output")
    if output and output.rstrip("/").endswith(".jsonl") and not top.get("dataset"):
        top["dataset"], top["output"] = output, output + ".rollflow"


def _head_server_default(settings: Any, groups: dict[str, dict[str, Any]], given: dict[str, Any]) -> None:
    """An agent run with no agent server given asks NeMo Gym's head server, at NeMo Gym's default."""
    from rollflow.settings.models import DEFAULT_HEAD_SERVER

    backend = groups["backend"]
    url_given = "url" in settings.backend.model_fields_set or "url" in given.get("backend", {})
    kind_given = "kind" in settings.backend.model_fields_set or "kind" in given.get("backend", {})
    if backend.get("head_server") and not kind_given:  # a head server names agents: an agent run
        backend["kind"] = "agent"
    if str(backend.get("kind")) != "agent" or backend.get("agents"):
        return
    if backend.get("head_server") and url_given:
        raise UsageError(
            "Both a head server and --backend-url were given: give the head server (agents found through "
            "it) or the agent server's URL, not both."
        )
    if not url_given and not backend.get("head_server"):
        backend["head_server"] = DEFAULT_HEAD_SERVER


def _json_overrides(raw: str) -> dict[str, Any]:
    example = "e.g. '{\"temperature\": 0.7}'"
    try:
        overrides = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"--overrides must be a JSON object, {example}: {exc}") from exc
    if not isinstance(overrides, dict):
        raise UsageError(f"--overrides must be a JSON object, {example}.")
    return overrides


def _validated_spec(groups: dict[str, dict[str, Any]]) -> Any:
    from pydantic import ValidationError

    from rollflow.flows.cli.flags import flag_label
    from rollflow.settings import RunSpec

    top = groups[""]
    if not top.get("input"):
        raise UsageError("No input: pass --input PATH (or set ROLLFLOW_PIPELINE__INPUT).")
    if not top.get("output"):
        raise UsageError("No output: pass --output DIR or s3://bucket/prefix (or ROLLFLOW_PIPELINE__OUTPUT).")
    try:
        return RunSpec.model_validate({**top, **{k: v for k, v in groups.items() if k}})
    except ValidationError as exc:
        problems = validation_problems(exc, flag_label)
        raise UsageError(f"Invalid settings: {problems}.") from exc


def cmd_run(args: argparse.Namespace, extra: list[str], flow_name: str) -> int:
    # `collect` is ng_collect_rollouts' and gym eval run's command: its rows go to NeMo Gym agents
    # (through the head server unless a URL is given), whichever of their flags is used.
    spec = command_spec(flow_name, args, extra)
    check_engine(spec)
    quiet_prefect(args.verbose)
    from rollflow.flows.cli.prefect_api import command_api
    from rollflow.flows.cli.start import settle

    api = command_api(args.started_at)  # a server being started comes up while the flows load
    from rollflow.flows.cli.runner import run_and_print

    settle()

    return run_and_print(
        spec,
        flow_name,
        progress=not args.no_progress,
        print_json=args.json,
        verbose=args.verbose,
        started_at=args.started_at,
        api=api,
    )


def cmd_simulate(argv: list[str]) -> int:
    from rollflow.infra.simulator import main as simulate_main

    return simulate_main(argv)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo on the same Prefect path as `run`: the configured API, else the kept local server."""
    quiet_prefect(args.verbose)
    from rollflow.flows.cli.prefect_api import command_api

    api = command_api(args.started_at)
    from rollflow.flows.cli.demo import run_demo

    return asyncio.run(
        run_demo(
            args.output,
            parallelism=args.parallelism,
            num_repeats=args.num_repeats,
            started_at=args.started_at,
            api=api,
        )
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, except that a line never breaks inside a flag (`--verify-` / `processes`), and an
    epilog (the +key=value list) keeps the lines it was given."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class VersionAction(argparse.Action):
    """--version, its version looked up only when asked: importlib.metadata scans sys.path (~30 ms), which
    every other command would pay while its parser is built."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show program's version number and exit")
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"rollflow {installed_version()}")
        parser.exit()


class Parser(argparse.ArgumentParser):
    """Every rollflow parser and subparser: HelpFormatter unless one is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; the settings-derived flags are added only to `command`'s parser,
    so `rollflow --help` and the other commands do not pay for importing the settings models."""
    parser = Parser(
        prog="rollflow", description="Maximum-throughput, resumable LLM rollout collection on Prefect."
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    from rollflow.flows.cli.values import parallelism_value

    def wanted(name: str) -> bool:
        return command == name

    run = sub.add_parser(
        "run",
        help="the whole pipeline: diagnose -> tune -> collect -> verify -> concatenate",
    )
    if wanted("run"):
        _add_run_flags(run, "run", tuning=True)
        from rollflow.flows.cli.nemo_gym import add_eval_flags, overrides_epilog

        add_eval_flags(run)
        run.epilog = overrides_epilog()
    for name, text in (
        ("diagnose", "diagnose-bottleneck: the same rows at a low and a high parallelism, and a verdict"),
        ("tune", "diagnose, then tune-parallelism: the throughput curve, the knee and the chosen value"),
    ):
        stage = sub.add_parser(name, help=text)
        if wanted(name):
            _add_run_flags(stage, name, tuning=True)
    collect = sub.add_parser(
        "collect",
        help="NeMo Gym's collection at a fixed parallelism: rows go to agents (--backend-kind agent), found "
        "through the head server unless --backend-url is given; takes ng_collect_rollouts' +key=value "
        "arguments and gym eval run's flags",
    )
    if wanted("collect"):
        _add_run_flags(collect, "collect")
        from rollflow.flows.cli.nemo_gym import add_eval_flags, overrides_epilog

        add_eval_flags(collect)
        collect.epilog = overrides_epilog()
    sub.add_parser(
        "simulate", help="start the simulated backend (see `rollflow simulate --help`)", add_help=False
    )
    from rollflow.flows.cli.serve_cmd import add_serve_parser

    add_serve_parser(sub)
    from rollflow.flows.cli.reverify_cmd import add_reverify_parser

    add_reverify_parser(sub, full=wanted("reverify"))
    from rollflow.flows.cli.ray_workers_cmd import add_ray_workers_parser

    add_ray_workers_parser(sub)
    demo = sub.add_parser("demo", help="run the pipeline against an in-process simulator on sample data")
    demo.add_argument("--output", default="demo-out", help="output directory (default %(default)s)")
    demo.add_argument(
        "--parallelism",
        type=parallelism_value,
        default="auto",
        help="N, auto or adaptive (default %(default)s)",
    )
    demo.add_argument("--num-repeats", type=int, default=16, help="rollouts per row (default %(default)s)")
    demo.add_argument("--verbose", action="store_true")
    return parser


def installed_version() -> str:
    """The installed distribution's version (the one pip shows), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollflow")
    except PackageNotFoundError:
        from rollflow import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """Called in-process with `argv` (tests), the command starts now; as the console script, at exec."""
    from rollflow.flows.cli.start import process_start

    fresh = argv is None
    started_at = process_start() if fresh else time.time()
    if fresh:
        terminate_like_ctrl_c()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        return cmd_simulate(argv[1:])
    try:  # from the first import on: a stop while the parser loads is one line too
        return _command(argv, started_at, fresh)
    except UsageError as exc:
        from rollflow.settings import redact  # a flag's text can hold an address's user:password

        print(f"rollflow: {redact.redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        term = isinstance(exc, Terminated)
        print(
            f"rollflow: {'terminated (SIGTERM)' if term else 'interrupted'} before any work.", file=sys.stderr
        )
        return EXIT_TERMINATED if term else EXIT_INTERRUPTED


def _command(argv: list[str], started_at: float, fresh: bool) -> int:
    from rollflow.flows.cli.start import collect_rarely

    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "serve":  # a served run's logs are its Logs tab in the UI
        quiet_prefect("--verbose" in argv)
    if fresh and command in ("run", "collect"):
        collect_rarely()  # until cmd_run has imported its flows
    parser = make_parser(command)
    args, extra = parser.parse_known_args(argv)
    args.started_at = started_at
    if args.command in ("run", "collect"):
        return cmd_run(args, extra, args.command)
    if args.command in ("diagnose", "tune"):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from rollflow.flows.cli.tuning_cmd import cmd_diagnose, cmd_tune

        spec = command_spec(args.command, args, [])
        return (cmd_diagnose if args.command == "diagnose" else cmd_tune)(args, spec)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "reverify":
        from rollflow.flows.cli.reverify_cmd import cmd_reverify

        return cmd_reverify(args)
    if args.command == "ray-workers":
        from rollflow.flows.cli.ray_workers_cmd import cmd_ray_workers

        return cmd_ray_workers(args)
    if args.command == "serve":
        from rollflow.flows.cli.serve_cmd import cmd_serve

        return cmd_serve(args)
    return cmd_demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
