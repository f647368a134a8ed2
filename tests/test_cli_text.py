"""What the CLI says: every default its --help states is the one a run gets, the +key=value arguments are
listed, --version, a backend URL given with its /v1, the summaries' values, a resumed run's first line and
reverify's progress from its start."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson
import pytest
from rollout_data import assert_complete, write_rows

from rollflow.flows.cli.flags import REVERIFY_FLAGS, RUN_FLAGS, TUNING_FLAGS
from rollflow.flows.cli.main import command_spec, make_parser
from rollflow.flows.cli.nemo_gym import KEYS, apply_nemo_gym, overrides_of
from rollflow.flows.cli.reverify_cmd import build_reverify_spec
from rollflow.flows.cli.runner import endpoints_table
from rollflow.settings import BackendParams, RollflowSettings, RunSpec
from rollflow.settings.models import url_notes
from rollflow.tasks.collect.percentiles import shown, shown_share
from rollflow.tasks.publish.endpoints import endpoints_markdown
from rollflow.tasks.publish.rewards import summary_line
from rollflow.tasks.publish.story import story_line, story_markdown

HERE = Path(__file__).parent
STATED = re.compile(r"\(default ([^)]*)\)")
COMMANDS = ("run", "collect", "diagnose", "tune", "reverify", "serve", "ray-workers", "demo")


def _fields(*tables: dict[str, tuple[tuple[str, str, str], ...]]) -> dict[str, tuple[str, str]]:
    return {f"--{flag}": (group, field) for t in tables for rows in t.values() for flag, group, field in rows}


RUN_FIELDS, REVERIFY_FIELDS = _fields(RUN_FLAGS, TUNING_FLAGS), _fields(REVERIFY_FLAGS)


@pytest.fixture
def clean_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ROLLFLOW_* variable and no .env: the defaults alone."""
    for name in [n for n in os.environ if n.startswith("ROLLFLOW_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = make_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _help_of(action: argparse.Action) -> str:
    return (action.help or "") % {**vars(action), "default": action.default}


def _as_said(value: Any) -> str:
    return str(getattr(value, "value", value))


def _spec_value(command: str, spec: Any, flag: str) -> Any:
    if command == "reverify":
        group, field = REVERIFY_FIELDS[flag]
        return getattr(spec.verify if group == "verify" else spec, field)
    group, field = RUN_FIELDS[flag]
    return getattr(spec if group == "" else getattr(spec, group), field)


def test_every_default_a_help_states_is_the_default_the_command_runs_with(clean_settings: Path) -> None:
    """`run --help` said `--parallelism ... (default 32)` while `run` tunes (auto): each "(default X)" of
    every command's --help is checked against the spec the command builds when the flag is left out."""
    checked: dict[str, int] = {}
    for command in COMMANDS:
        parser = _subparser(command)
        broken = re.search(r"--[a-z0-9-]*-\n", parser.format_help())
        assert broken is None, (command, "a flag split over two lines", broken)
        spec = None
        if command in ("run", "collect", "diagnose", "tune"):
            args, extra = parser.parse_known_args(["--input", "in.jsonl", "--output", str(clean_settings)])
            spec = command_spec(command, args, extra)
        elif command == "reverify":
            spec = build_reverify_spec(parser.parse_args(["src", "--output", str(clean_settings / "rv")]))
        for action in parser._actions:
            said = STATED.search(_help_of(action))
            if said is None:
                continue
            flag = action.option_strings[-1]
            if action.default is not None:
                real = action.default
            else:
                known = REVERIFY_FIELDS if command == "reverify" else RUN_FIELDS
                assert spec is not None and flag in known, (command, flag, "states a default it lacks")
                real = _spec_value(command, spec, flag)
            assert said.group(1) == _as_said(real), (command, flag, said.group(1), real)
            checked[command] = checked.get(command, 0) + 1
    assert checked.keys() >= {"run", "collect", "reverify", "serve", "demo"}, checked
    run_help = _subparser("run").format_help()
    assert "(default 32)" not in run_help and "follows latency and 429s) (default auto)" in run_help
    assert "(default agent)" in _subparser("collect").format_help()


@pytest.mark.parametrize("command", ["collect", "run"])
def test_help_lists_every_nemo_gym_key_the_parser_takes(command: str) -> None:
    """An unknown +key sends the user to `collect --help`: it lists each key, from the table the parser
    reads them by, and each key it lists is one the parser knows."""
    text = _subparser(command).format_help()
    for key in KEYS:
        assert f"+{key}" in text, key
    assert "+head_server.host" in text and "+head_server.port" in text
    listed = set(re.findall(r"(?<![\w+])\+([a-z_]+(?:\.[a-z_]+)?)", text))
    assert listed, text
    for key in listed:
        if key == "key" or key.split(".")[0] in ("head_server", "responses_create_params", "agent_map"):
            continue  # +key=value itself, and the dotted examples
        assert key in KEYS, key
    with pytest.raises(Exception, match="cannot honour"):
        apply_nemo_gym(overrides_of(["+no_such_key=1"], argparse.Namespace()), _groups())


def _groups() -> dict[str, dict[str, Any]]:
    return {"": {}, "backend": {}, "collection": {"overrides": {}}, "verify": {}, "tuning": {}}


def test_version_is_the_installed_distributions() -> None:
    exe = str(Path(sys.executable).with_name("rollflow"))
    res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"rollflow {version('rollflow')}"


def test_help_does_not_look_up_the_version() -> None:
    """Only --version reads the installed distribution's metadata (a scan of sys.path): `rollflow --help`,
    which every command's parser building shares, never imports importlib.metadata."""
    exe = str(Path(sys.executable).with_name("rollflow"))
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 and "usage: rollflow" in res.stdout, res.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")
    }
    assert "rollflow.flows.cli.main" in imported and "importlib.metadata" not in imported


def test_a_v1_suffix_is_taken_off_wherever_the_url_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """The responses and chat backends add /v1/... themselves: a base given with its /v1 (as OpenAI clients
    take it) is the same server; the flag, the environment, a flow run's parameters and a replica list all
    pass the one validator. An agent server's /run has no /v1: its URL stays as given."""
    url_notes()
    for kind in ("chat", "responses"):
        b = BackendParams(kind=kind, url="http://h1:8000/v1, http://h2:8000/v1/,http://h3/openai/v1")
        assert b.urls == ["http://h1:8000", "http://h2:8000", "http://h3/openai"]
    notes = url_notes()
    assert (
        len(notes) == 3 and "http://h1:8000/v1 ends in /v1" in notes[0] and "using http://h1:8000" in notes[0]
    )
    BackendParams(kind="chat", url="http://h1:8000/v1")
    assert url_notes() == [], "each URL is said once"
    assert BackendParams(kind="agent", url="http://a:9000/v1").url == "http://a:9000/v1"
    assert BackendParams(kind="chat", url="http://h:8000/v10").url == "http://h:8000/v10"
    for given in ("http://h:8000/v1/chat/completions", "http://h:8000/V1", "http://h:8000/v1/responses/"):
        assert BackendParams(kind="chat", url=given).url == "http://h:8000", (
            given
        )  # a full endpoint, any case
    assert BackendParams(kind="chat", url="http://h:8000/v1?x=1").url == "http://h:8000?x=1"  # query kept
    monkeypatch.setenv("ROLLFLOW_BACKEND__URL", "http://env:8000/v1/")
    monkeypatch.setenv("ROLLFLOW_BACKEND__KIND", "chat")
    assert RollflowSettings().backend.urls == ["http://env:8000"]
    spec = RunSpec(input="i", output="o", backend={"kind": "responses", "url": "http://p:8000/v1"})
    given = {"input": "i", "output": "o", "backend": {"url": "http://q:1/v1"}}  # a flow run's parameters
    served = RunSpec.merged(RunSpec.fields_from(RollflowSettings()), given)
    assert spec.backend.url == "http://p:8000" and served.backend.url == "http://q:1"


def test_a_run_given_a_v1_url_collects_and_says_so_once(run_cli, fast_sim, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "chat",
        "--backend-url", f"{fast_sim.url}/v1", "--parallelism", "8", "--no-progress", timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 20, 1)
    said = f"rollflow: the backend URL {fast_sim.url}/v1 ends in /v1"
    assert res.stderr.count(said) == 1, res.stderr[-3000:]
    assert res.stderr.index(said) == 0, "said before the run"


def test_one_way_to_write_a_summary_value() -> None:
    assert [shown(v) for v in (None, 138.405, 4096.0, 12.04, 0.123456, 3, 1234567)] == [
        "-", "138", "4,096", "12", "0.123", "3", "1,234,567",
    ]  # fmt: skip
    assert shown(None, missing="not set") == "not set"
    assert [shown(v) for v in (0.9996, 0.0004, 0.5)] == ["0.9996", "0.0004", "0.5"]  # never a false 1 or 0
    assert [shown_share(f) for f in (0, 0.005, 0.0004, 0.25, 0.1234, 0.9996, 1.0, None)] == [
        "0%", "0.5%", "<0.1%", "25%", "12.3%", ">99.9%", "100%", "-",
    ]  # fmt: skip


def _story() -> dict[str, Any]:
    tokens = {"rollouts": 200, "mean": 138.405, "p50": 120.0, "p95": 247.35, "max": 255, "total": 27681}
    return {
        "sent": {
            "backend_kind": "chat", "model": "m", "endpoints": ["http://h"], "models_answered": {"m": 200},
            "overrides": {}, "sampling_params": {}, "seed": None, "num_repeats": 1,
        },
        "scored_by": {
            "name": "exact_match", "library": None, "library_version": None, "correct_threshold": 1.0,
        },
        "origin": {"rollflow_version": "0", "input": "in", "input_sha256": "0" * 64, "input_rows": 200},
        "returned": {
            "tokens_in": dict(tokens), "tokens_out": tokens, "truncation_rate": 0.004,
            "finish_reasons": {}, "failures_by_kind": {},
        },
    }  # fmt: skip


def test_summaries_show_values_not_raw_floats_or_none() -> None:
    """`seed None`, `tokens out mean 138.405` and `0% all correct` when 0.5% were."""
    line = story_line(_story())
    assert "seed not set" in line and "tokens out mean 138, p95 247, max 255" in line, line
    assert "truncated 0.4%" in line and "None" not in line, line
    md = story_markdown(_story())
    assert "| seed | not set |" in md and "| out | 138 | 120 | 247 | 255 | 27,681 |" in md, md
    rewards = {
        "rollouts": 800, "mean": 0.25, "std": 0.43, "tasks": 200,
        "all_correct": {"tasks": 1, "share": 0.005}, "none_correct": {"tasks": 149, "share": 0.745},
        "mixed": {"tasks": 50, "share": 0.25}, "pass_at_k": {"1": 0.25, "4": 0.4},
    }  # fmt: skip
    assert "0.5% all correct, 74.5% none, 25% mixed" in summary_line(rewards), summary_line(rewards)


def test_the_engine_column_is_explained_where_it_is_shown() -> None:
    row = {
        "url": "http://h", "rollouts": 10, "rollouts_per_s": 2.5, "errors": 0, "limit": 32,
        "out_of_rotation_s": 0.0, "engine": {"running_max": 32, "waiting_max": 8, "kv_cache_usage_max": 1.0},
    }  # fmt: skip
    table = endpoints_table({"endpoints": [row]})
    assert table is not None
    text = io.StringIO()
    from rich.console import Console

    Console(file=text, width=100).print(table)
    assert "32/8/100%" in text.getvalue() and "running/waiting/KV-cache" in text.getvalue(), text.getvalue()
    md = endpoints_markdown([row])
    assert "32/8/100%" in md and "running/waiting/KV-cache" in md, md


def _run(run_cli, inp: Path, out: Path, sim_url: str, *extra: str):
    return run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", sim_url,
        "--num-repeats", "2", "--parallelism", "8", "--chunk-size", "20", "--keep-chunks", *extra,
        timeout=240,
    )  # fmt: skip


def test_a_resumed_run_says_how_much_it_already_has(run_cli, fast_sim, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out"
    first = _run(run_cli, inp, out, fast_sim.url, "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resuming" not in first.stderr
    (out / "chunks" / "00002.json").unlink()  # as a run stopped before its last chunk committed
    again = _run(run_cli, inp, out, fast_sim.url, "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rollflow: resuming: 80 of 120 rollouts already committed" in again.stderr, again.stderr[-3000:]
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 60, 2)


def test_reverify_shows_progress_from_its_start(run_cli, fast_sim, tmp_path: Path) -> None:
    """Before its first check: what started, Prefect, the scan, the plan and the verifier processes."""
    inp = write_rows(tmp_path / "in.jsonl", 30)
    source = tmp_path / "src"
    done = _run(run_cli, inp, source, fast_sim.url, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    rv = tmp_path / "rv"
    res = run_cli(
        "reverify", str(source), "--output", str(rv), "--verifier", "busy_verifier:score",
        "--verify-processes", "1", "--chunk-size", "20", timeout=240, env={"PYTHONPATH": str(HERE)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("rollflow: ")]
    assert (
        lines[0] == f"rollflow: reverify started: source {source}, output {rv}, verifier busy_verifier:score"
    )
    expected = [
        "rollflow: loading Prefect and the flow",
        "rollflow: starting the flow (Prefect API: ",
        f"rollflow: scanning the source {source}",
        "rollflow: 60 rollouts planned",
        "rollflow: starting 1 verifier process (busy_verifier:score)",
        "rollflow: rescore 60/60 rollouts (100%)",
        "rollflow: comparing the rewards and publishing",
    ]
    at = [next((i for i, line in enumerate(lines) if line.startswith(e)), -1) for e in expected]
    assert -1 not in at and at == sorted(at), (at, lines)
    quiet = run_cli(
        "reverify", str(source), "--output", str(tmp_path / "rv2"), "--verifier", "exact_match",
        "--no-progress", timeout=240,
    )  # fmt: skip
    assert quiet.returncode == 0 and "rollflow: " not in quiet.stderr, quiet.stderr[-3000:]


def test_reverify_flags_come_from_its_settings(clean_settings: Path) -> None:
    parser = _subparser("reverify")
    args = parser.parse_args(["src", "--output", "o", "--chunk-size", "7", "--verify-processes", "0"])
    spec = build_reverify_spec(args)
    assert (spec.chunk_size, spec.verify.processes, spec.restart, spec.format) == (7, 0, False, "jsonl")
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["src", "--output", "o", "--runner", "nope"])
    assert orjson.dumps(spec.verify.model_dump(mode="json"))
