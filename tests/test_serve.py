"""Served deployments: a scheduled run uses the served defaults; a run started with one field changed
runs with exactly that field changed and every other as served; a change of the output's run identity
and bad parameters are refused. One `rollflow serve` process serves every run of the module."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from rollout_data import assert_complete, write_rows
from served_runs import artifacts, call, deployment, ok, serve, spec_in_force, start_run, wait_final

ROWS = 8
PREFECT = str(Path(sys.executable).with_name("prefect"))
# A verifier the served process imports from the test's directory: every reward 0.5, unlike math_fast's.
HALF = "def score(row, text):\n    return 0.5\n"
# A check that marks it began, then hangs: the run is busy when the UI cancels it.
HANGS = (
    "import pathlib, time\n"
    "def score(row, text):\n"
    "    pathlib.Path(row['mark']).write_text('began')\n"
    "    time.sleep(3600)\n"
)


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    api: str
    env: dict[str, str]
    deployment: dict[str, Any]
    input: Path
    output: Path
    work: Path
    scheduled: dict[str, Any] | None = None


@pytest.fixture(scope="module")
def served(cli_env, prefect_server, fast_sim, tmp_path_factory) -> Iterator[Served]:
    """`rollflow serve` every 5 s, its defaults from ROLLFLOW_* as in the issue: chat at a URL, model m,
    2 repeats, math_fast."""
    work = tmp_path_factory.mktemp("served")
    (work / "half_reward.py").write_text(HALF)
    (work / "hangs.py").write_text(HANGS)
    inp = write_rows(work / "rows.jsonl", ROWS)
    env = {
        **cli_env,
        "PYTHONPATH": str(work),
        "ROLLFLOW_PIPELINE__INPUT": str(inp),
        "ROLLFLOW_PIPELINE__OUTPUT": str(work / "served-out"),
        "ROLLFLOW_BACKEND__KIND": "chat",
        "ROLLFLOW_BACKEND__URL": fast_sim.url,
        "ROLLFLOW_BACKEND__MODEL": "m",
        "ROLLFLOW_COLLECTION__NUM_REPEATS": "2",
        "ROLLFLOW_COLLECTION__PARALLELISM": "8",
        "ROLLFLOW_VERIFY__VERIFIER": "math_fast",
        "ROLLFLOW_VERIFY__PROCESSES": "0",
    }
    proc = serve(env, "--name", "test", "--interval-s", "5", "--limit", "1")  # one run at a time
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        found = deployment(api, "test", proc)
        yield Served(proc, api, env, found, inp, work / "served-out", work)
    finally:
        proc.terminate()
        proc.wait(30)


def served_parameters(s: Served) -> dict[str, Any]:
    """The deployment's parameters, checked against the ROLLFLOW_* values it was served with."""
    params = copy.deepcopy(s.deployment["parameters"])
    assert params["input"] == str(s.input) and params["output"] == str(s.output), params
    backend, fast_sim_url = params["backend"], s.env["ROLLFLOW_BACKEND__URL"]
    assert (backend["kind"], backend["url"], backend["model"]) == ("chat", fast_sim_url, "m"), backend
    assert params["collection"]["num_repeats"] == 2 and params["verify"]["verifier"] == "math_fast"
    return params


def check_dataset(out: Path, rows: int, repeats: int, rewards: set[float]) -> None:
    """Every (task, rollout) once; each reply a chat completion from model m; rewards as its verifier's."""
    lines = (out / "rollouts.jsonl").read_bytes().splitlines()
    assert_complete(lines, rows, repeats)
    found = [orjson.loads(line) for line in lines]
    # a chat reply keeps its chat.completion id in the Responses-shaped row
    assert {(r["response"]["id"][:9], r["response"]["model"]) for r in found} == {("chatcmpl-", "m")}
    assert {r["reward"] for r in found} <= rewards, {r["reward"] for r in found}


def first_scheduled_run(s: Served) -> dict[str, Any]:
    """The schedule's first completed run; then the schedule is paused (Prefect deletes the runs it
    queued) and any run it started has ended, so the runs a test starts have the output to themselves."""
    if s.scheduled is not None:
        return s.scheduled
    dep_id = s.deployment["id"]
    query = {"flow_runs": {"deployment_id": {"any_": [dep_id]}, "state": {"type": {"any_": ["COMPLETED"]}}}}
    deadline, done = time.monotonic() + 120, []
    while not done and time.monotonic() < deadline:
        assert s.proc.poll() is None, s.proc.stderr.read().decode()[-3000:] if s.proc.stderr else ""
        time.sleep(1)
        done = ok(s.api, "/flow_runs/filter", query)
    assert done, "no scheduled run completed within 120 s"
    ok(s.api, f"/deployments/{dep_id}/pause_deployment", {})
    _no_scheduled_run_left(s.api, dep_id)
    s.scheduled = done[0]
    return s.scheduled


def _no_scheduled_run_left(api: str, dep_id: str) -> None:
    """Pausing deletes the runs the schedule queued for later, not one already due (Late on a busy
    machine), which the served process then started into the served output after a test had emptied it:
    those are deleted, and runs under way waited for, until none is left."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        runs = ok(api, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep_id]}}})
        live = [r for r in runs if r["state"]["type"] in ("SCHEDULED", "PENDING", "RUNNING")]
        if not live:
            return
        for run in live:
            if run["state"]["type"] == "SCHEDULED":
                call(api, f"/flow_runs/{run['id']}", method="DELETE")
            else:
                wait_final(api, run["id"])
    raise AssertionError("the paused schedule's runs did not end within 180 s")


def test_a_scheduled_run_publishes_with_the_served_defaults(served: Served) -> None:
    run = first_scheduled_run(served)
    params = served_parameters(served)
    assert run["auto_scheduled"] and run["parameters"] == params, run["parameters"]
    check_dataset(served.output, ROWS, 2, {0.0, 1.0})
    report = orjson.loads((served.output / "report.json").read_bytes())
    assert spec_in_force(report) == params
    keys = artifacts(served.api, run["id"])
    assert {"rollflow-progress", "rollflow-report", "rollflow-dataset"} <= set(keys), keys
    assert keys["rollflow-progress"]["data"] == 100.0
    assert keys["rollflow-dataset"]["data"].endswith(f"({served.output.as_uri()}/rollouts.jsonl)")
    assert "rows_written | 16" in keys["rollflow-report"]["data"]


def test_a_change_of_the_output_run_identity_is_refused(served: Served) -> None:
    """The served output holds the scheduled run's chunks (2 repeats): 3 repeats there is refused."""
    first_scheduled_run(served)
    before = (served.output / "rollouts.jsonl").read_bytes()
    run = start_run(served.api, served.deployment["id"], {"collection": {"num_repeats": 3}})
    run = wait_final(served.api, run["id"])
    message = run["state"]["message"] or ""
    assert run["state"]["type"] == "FAILED", f"{run['state']['type']}: {message}"
    assert "holds a different run" in message, message
    assert "collection.num_repeats 2 -> 3" in message, message
    assert (served.output / "rollouts.jsonl").read_bytes() == before


CHANGES = {
    "num_repeats": ("collection", "num_repeats", 3),
    "limit": ("collection", "limit", 4),
    "output": (None, "output", "changed-out"),
    "verifier": ("verify", "verifier", "half_reward:score"),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_run_with_one_field_changed_keeps_every_other_as_served(served: Served, name: str) -> None:
    section, field, value = CHANGES[name]
    if field == "output":
        value = str(served.work / value)
    expected = served_parameters(served)
    (expected[section] if section else expected)[field] = value
    given = {section: {field: value}} if section else {field: value}
    first_scheduled_run(served)
    shutil.rmtree(served.output, ignore_errors=True)  # each run starts the served output afresh
    if name == "limit":  # as a user would: `prefect deployment run ... --param collection='{"limit": 4}'`
        param = "collection=" + orjson.dumps({field: value}).decode()
        trigger = subprocess.run(
            [PREFECT, "deployment", "run", "rollflow-run/test", "--param", param],
            env=served.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert trigger.returncode == 0, trigger.stdout[-2000:] + trigger.stderr[-2000:]
        run = {"id": re.search(r"UUID: *([0-9a-f-]{36})", trigger.stdout)[1]}
    else:
        run = start_run(served.api, served.deployment["id"], given)
    run = wait_final(served.api, run["id"])
    assert run["state"]["type"] == "COMPLETED", f"{run['state']['type']}: {run['state']['message']}"
    out = Path(expected["output"])
    report = orjson.loads((out / "report.json").read_bytes())
    assert spec_in_force(report) == expected, (
        "the report's values in force: the one field changed, the rest as served"
    )
    rows, repeats = expected["collection"]["limit"] or ROWS, expected["collection"]["num_repeats"]
    check_dataset(out, rows, repeats, {0.5} if name == "verifier" else {0.0, 1.0})
    assert (
        orjson.loads((out / "run.json").read_bytes())["config"]["verifier"] == expected["verify"]["verifier"]
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"collection": {"parallelism": -1}}, "parallelism"),
        ({"backend": {"kind": "grpc"}}, "kind"),
        ({"verify": {"verifier": "fuzzy"}}, "verifier"),
        ({"collection": {"limti": 4}}, "limti"),  # a misspelt field must not run as if left out
        ({"colection": {"limit": 4}}, "colection"),  # nor a misspelt section crash the run
        # a field the run fills from the head server was on the form, to be set by hand
        ({"backend": {"agents": {"a": {"url": "http://127.0.0.1:9"}}}}, "agents"),
    ],
)
def test_bad_parameters_are_refused(served: Served, tmp_path, change, needle) -> None:
    first_scheduled_run(served)
    out = tmp_path / "never-written"
    status, run = call(
        served.api, f"/deployments/{served.deployment['id']}/create_flow_run",
        {"parameters": {"output": str(out), **change}},
    )  # fmt: skip
    if status < 300:  # accepted by the API: then the flow itself must refuse it
        run = wait_final(served.api, run["id"], 120)
        outcome = f"{run['state']['type']}: {run['state']['message']}"
        assert run["state"]["type"] == "FAILED", outcome
    else:
        outcome = f"refused {status}: {run}"
        assert status in (409, 422), outcome
    assert needle in outcome
    assert not out.exists(), "a refused run must write nothing"


def test_a_misspelt_field_is_refused_by_the_diagnose_and_tune_deployments(served: Served) -> None:
    for flow in ("rollflow-diagnose", "rollflow-tune"):
        dep = ok(served.api, f"/deployments/name/{flow}/test")
        for change, needle in (
            ({"tuning": {"diagnose_rowz": 4}}, "diagnose_rowz"),
            ({"tunning": {}}, "tunning"),
        ):
            status, found = call(
                served.api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": change}
            )
            assert status == 409 and needle in str(found), f"{flow} {change}: {status} {found}"


def test_serve_refuses_a_misspelt_setting_in_dotenv_by_name(run_cli, tmp_path) -> None:
    """A typo in the served defaults must not serve the built-in value in its place."""
    (tmp_path / ".env").write_text("ROLLFLOW_COLLECTION__NUM_REPEAT=2\n")
    res = run_cli("serve", "--name", "typo", cwd=str(tmp_path), timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "ROLLFLOW_COLLECTION__NUM_REPEAT" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_cancelling_a_run_from_the_ui_ends_it_cancelled_while_a_check_hangs(served: Served) -> None:
    """The Cancel button: Prefect's runner tells the run, then sends SIGTERM; the run ends Cancelled."""
    first_scheduled_run(served)
    mark = served.work / "began"
    inp = served.work / "hang-rows.jsonl"
    inp.write_bytes(orjson.dumps({"responses_create_params": {"input": "q"}, "mark": str(mark)}) + b"\n")
    given = {
        "input": str(inp),
        "output": str(served.work / "cancelled-out"),
        "verify": {"verifier": "hangs:score", "check_timeout_s": 600},
    }
    run = start_run(served.api, served.deployment["id"], given)
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.exists(), ok(served.api, f"/flow_runs/{run['id']}")["state"]
    ok(served.api, f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    run = wait_final(served.api, run["id"], timeout_s=90)
    assert run["state"]["type"] == "CANCELLED", f"{run['state']['type']}: {run['state']['message']}"
