"""Scheduled runs that work every night: a served cron schedule with its timezone, an interval schedule
whose runs publish each into its own folder (a templated output), named runs, and one-line refusals.

Each failed on the code before: `serve --cron` crashed (to_deployment took no `timezone`), an output
could not name its run, runs had Prefect's random names, and a served usage error was a traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from rollout_data import assert_complete, write_rows
from served_runs import call, deployment, ok, serve, start_run, wait_final

ROWS = 6
NAME = re.compile(r"^rows-m-\d{4}-\d{6}-(nightly|every)$")


def served_env(cli_env: dict[str, str], url: str, inp: Path, output: str) -> dict[str, str]:
    return {
        **cli_env,
        "ROLLFLOW_PIPELINE__INPUT": str(inp),
        "ROLLFLOW_PIPELINE__OUTPUT": output,
        "ROLLFLOW_BACKEND__KIND": "chat",
        "ROLLFLOW_BACKEND__URL": url,
        "ROLLFLOW_BACKEND__MODEL": "m",
        "ROLLFLOW_COLLECTION__PARALLELISM": "4",
        "ROLLFLOW_VERIFY__VERIFIER": "math_fast",
        "ROLLFLOW_VERIFY__PROCESSES": "0",
    }


def runs_of(
    api: str, dep: dict, proc, at_least: int, timeout_s: float, states: list[str] | None = None
) -> list:
    """The deployment's flow runs (in `states`, when given) once there are `at_least`, or at the timeout."""
    query: dict = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}
    if states:
        query["flow_runs"]["state"] = {"type": {"any_": states}}
    deadline, found = time.monotonic() + timeout_s, []
    while len(found) < at_least and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else "serve exited"
        time.sleep(1)
        found = ok(api, "/flow_runs/filter", query)
    return found


def run_logs(api: str, run_id: str, last: str, timeout_s: float = 30) -> list[str]:
    """The flow run's log lines once one starts with `last` (Prefect sends logs in batches)."""
    deadline, messages = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        logs = ok(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
        messages = [entry["message"] for entry in logs]
        if any(m.startswith(last) for m in messages):
            break
        time.sleep(1)
    return messages


def test_a_served_cron_schedule_keeps_its_timezone(cli_env, prefect_server, fast_sim, tmp_path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    env = served_env(cli_env, fast_sim.url, inp, str(tmp_path / "runs" / "{date}"))
    proc = serve(env, "--name", "nightly", "--cron", "0 2 * * *", "--timezone", "Europe/Paris")
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        dep = deployment(api, "nightly", proc)
        (schedule,) = [s["schedule"] for s in dep["schedules"]]
        assert (schedule["cron"], schedule["timezone"]) == ("0 2 * * *", "Europe/Paris"), schedule
        runs = runs_of(api, dep, proc, 1, 60)
        assert runs, "the scheduler queued no run within 60 s"
        for run in runs:
            when = datetime.fromisoformat(run["expected_start_time"]).astimezone(ZoneInfo("Europe/Paris"))
            assert (when.hour, when.minute) == (2, 0), when
        ok(api, f"/deployments/{dep['id']}/pause_deployment", {})
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("args", "needle"), [
    (("--cron", "0 2 * *"), "is not a cron expression"),
    (("--cron", "0 2 * * *", "--timezone", "Mars/Olympus"), "is not a timezone name"),
    (("--interval-s", "0"), "must be a number of seconds from 1"),
    (("--interval-s", "0.001"), "must be a number of seconds from 1"),
    (("--interval-s", "nan"), "must be a number of seconds from 1"),
    (("--cron", ""), "is not a cron expression"),
    (("--interval-s", "60", "--timezone", "Bad/Zone"), "is not a timezone name"),
    (("--cron", "0 2 * * *", "--interval-s", "60"), "exclude each other"),
    (("--cron", "0 2 30 2 *"), "names no date in the next 8 years"),  # was served, and never ran
])  # fmt: skip
def test_a_bad_schedule_is_one_usage_error(run_cli, fast_sim, tmp_path, args, needle) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", 2)
    env = {"ROLLFLOW_PIPELINE__INPUT": str(inp), "ROLLFLOW_PIPELINE__OUTPUT": str(tmp_path / "o")}
    res = run_cli("serve", "--name", "bad", *args, env=env, timeout=120)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_an_interval_schedule_publishes_each_run_into_its_own_folder(
    cli_env, prefect_server, fast_sim, tmp_path
) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    env = served_env(cli_env, fast_sim.url, inp, str(tmp_path / "runs" / "{flow_run_id}"))
    proc = serve(env, "--name", "every", "--interval-s", "2", "--limit", "1")
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        dep = deployment(api, "every", proc)
        done = runs_of(api, dep, proc, 2, 180, ["COMPLETED"])
        ok(api, f"/deployments/{dep['id']}/pause_deployment", {})
        assert len(done) >= 2, "fewer than two scheduled runs completed within 180 s"
        for run in done[:2]:
            assert run["auto_scheduled"] and NAME.match(run["name"]), run["name"]
            out = tmp_path / "runs" / run["id"]
            assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), ROWS, 1)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_served_usage_error_ends_failed_in_one_line(cli_env, prefect_server, fast_sim, tmp_path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    env = served_env(cli_env, fast_sim.url, inp, str(tmp_path / "served"))
    proc = serve(env, "--name", "refuse")
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        dep = deployment(api, "refuse", proc)
        missing = tmp_path / "nowhere.jsonl"
        for change, needle in (
            ({"output": str(tmp_path / "runs" / "{dat}")}, "{dat}"),
            ({"input": str(missing)}, f"{missing} does not exist"),
        ):
            status, run = call(api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": change})
            assert status < 300, run
            run = wait_final(api, run["id"], 120)
            message = run["state"]["message"] or ""
            assert run["state"]["type"] == "FAILED" and needle in message, message
            assert "\n" not in message and "Traceback" not in message, message
            # the Logs tab says it once, with no traceback (the plan task's failure logged one)
            logs = run_logs(api, run["id"], "Finished in state")
            assert not [m for m in logs if "Traceback" in m or "Task run failed" in m], logs
        run = wait_final(api, start_run(api, dep["id"], {})["id"], 120)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        # the Logs tab shows the run's progress and its outcome
        messages = run_logs(api, run["id"], "published: ")
        assert any(m.startswith(f"collect {ROWS}/{ROWS} rollouts (100%)") for m in messages), messages
        assert any(m.startswith(f"published: {ROWS} rollouts") for m in messages), messages
    finally:
        proc.terminate()
        proc.wait(30)


def test_params_hash_names_what_is_collected_only() -> None:
    """{params_hash} changed with parallelism, timeouts or the deadline, so a rerun that only changed those
    (or dropped its deadline to resume) started over in a fresh folder."""
    from rollflow.settings import RunSpec

    base = RunSpec(input="rows.jsonl", output="runs/{params_hash}")
    same = base.model_copy(
        update={
            "deadline_s": 600.0,
            "collection": base.collection.model_copy(update={"parallelism": 5}),
            "backend": base.backend.model_copy(update={"timeout_s": 300.0}),
        }
    )
    other = base.model_copy(update={"collection": base.collection.model_copy(update={"num_repeats": 4})})
    assert base.expanded({}).output == same.expanded({}).output != other.expanded({}).output
    with pytest.raises(ValueError, match="no format or conversion"):
        RunSpec(input="rows.jsonl", output="runs/{date:x}")


def test_date_placeholders_follow_the_schedules_timezone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Los Angeles run at 22:00 on 1 December wrote into `2026-12-02`: {date} was always UTC."""
    from datetime import UTC, datetime

    from prefect.runtime import flow_run

    from rollflow.flows.parameters import SCHEDULE_TIMEZONE_ENV, runtime_values

    scheduled = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)
    monkeypatch.setitem(flow_run.FIELDS, "scheduled_start_time", lambda: scheduled)
    monkeypatch.delenv(SCHEDULE_TIMEZONE_ENV, raising=False)
    assert runtime_values()["date"] == "2026-12-02" and runtime_values()["datetime"] == "20261202T060000Z"
    monkeypatch.setenv(SCHEDULE_TIMEZONE_ENV, "America/Los_Angeles")
    values = runtime_values()
    assert values["date"] == "2026-12-01" and values["datetime"] == "20261201T220000-0800", values


def test_a_placeholders_value_is_one_path_segment() -> None:
    """`serve --name ..` with output `.../sub/{deployment}` published into the parent folder."""
    from rollflow.settings.spec import fill

    assert fill("s3://b/runs/sub/{deployment}", {"deployment": ".."}) == "s3://b/runs/sub/none"
    assert (
        fill("/o/{deployment}/{date}", {"deployment": "a/../b", "date": "2026-12-02"})
        == "/o/a-..-b/2026-12-02"
    )
    assert fill("/o/{flow_run_name}", {"flow_run_name": ""}) == "/o/none"


@pytest.mark.alone  # the serve's stop is bounded by 60 s, which three loaded test files reached twice
@pytest.mark.parametrize("to", ["group", "serve", "sigterm", "burst"])
def test_ctrl_c_on_serve_ends_the_run_it_was_running(cli_env, prefect_server, tmp_path, to) -> None:
    """Ctrl-C on `rollflow serve` (SIGINT to its process group, as a terminal sends it) ended the served
    run's process with it, and the run stayed RUNNING in the UI for ever. A run process the signal never
    reached (`kill -INT` to serve alone), or that went on after it, held serve until the run ended: now
    it has 20 s to stop, then SIGTERM, then SIGKILL. A SIGTERM to serve alone (systemd, Kubernetes, kill)
    held it until the run ended too (a CI run waited 30 s in vain): it is passed on to the run at once,
    and serve is gone within Kubernetes' default grace of 30 s. More signals while it stops (a burst of
    SIGTERM and SIGINT) crashed it with a traceback and left the run Running: they wait for it now."""
    import os
    import signal
    import subprocess
    import sys

    from rollflow.infra.local import spawn_simulator

    slow = spawn_simulator("--latency-ms", "2000")
    inp = write_rows(tmp_path / "rows.jsonl", 400)
    env = {
        **served_env(cli_env, slow.url, inp, str(tmp_path / "served")),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    exe = str(Path(sys.executable).with_name("rollflow"))
    proc = subprocess.Popen(
        [exe, "serve", "--name", f"ctrlc-{to}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        dep = deployment(api, f"ctrlc-{to}", proc)
        run_id = start_run(api, dep["id"], {})["id"]
        deadline = time.monotonic() + 120
        while ok(api, f"/flow_runs/{run_id}")["state"]["type"] != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # well into its collection (every request takes 2 s)
        term = to in ("sigterm", "burst")
        sig, bound_s = (signal.SIGTERM, 30) if term else (signal.SIGINT, 60)
        (os.killpg if to == "group" else os.kill)(proc.pid, sig)
        if to == "burst":  # a supervisor's repeats, a double Ctrl-C: every 50 ms until serve is gone
            again = time.monotonic() + bound_s
            for i in itertools.count():
                if proc.poll() is not None or time.monotonic() > again:
                    break
                time.sleep(0.05)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, (signal.SIGINT, signal.SIGTERM)[i % 2])
        try:
            proc.wait(bound_s)
        except subprocess.TimeoutExpired:  # say where its stop was stuck
            os.killpg(proc.pid, signal.SIGKILL)
            said = proc.communicate(timeout=30)[1][-3000:]
            pytest.fail(f"serve still running {bound_s} s after {sig.name}; its stderr: {said!r}")
        said = proc.stderr.read().decode() if proc.stderr else ""
        assert f"rollflow serve: stopped ({'SIGTERM' if term else 'Ctrl-C'})." in said, said[-2000:]
        assert "serve_cmd.py" not in said and "Event loop is closed" not in said, said[-3000:]  # its own
        # a signal of the burst may land in the interpreter's exit, after the work, where the default
        # handlers are back: the exit status is then the signal's, not a stop left half done
        ended_by = (0, -signal.SIGTERM, -signal.SIGINT) if to == "burst" else (0,)
        assert proc.returncode in ended_by, (proc.returncode, said[-2000:])
        run = wait_final(api, run_id, 60)
        assert run["state"]["type"] in ("CRASHED", "CANCELLED"), run["state"]
        assert (
            "rollflow serve stopped" in (run["state"]["message"] or "") or run["state"]["type"] == "CANCELLED"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        slow.stop()


def test_a_served_auto_run_logs_its_verdict_and_chosen_parallelism(
    cli_env, prefect_server, fast_sim, tmp_path
):
    """The Logs tab had no word of diagnose and tune: the verdict and the chosen parallelism were only in
    artifacts."""
    inp = write_rows(tmp_path / "rows.jsonl", 600)
    env = {
        **served_env(cli_env, fast_sim.url, inp, str(tmp_path / "auto")),
        "ROLLFLOW_COLLECTION__PARALLELISM": "auto",
        "ROLLFLOW_TUNING__DIAGNOSE_ROWS": "20",
        "ROLLFLOW_TUNING__TUNE_STEP_ROLLOUTS": "20",
    }
    proc = serve(env, "--name", "auto")
    api = prefect_server.env["PREFECT_API_URL"]
    try:
        dep = deployment(api, "auto", proc)
        run = wait_final(api, start_run(api, dep["id"], {})["id"], 240)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        logs = run_logs(api, run["id"], "published: ")
        assert any(m.startswith("diagnose-bottleneck: ") for m in logs), logs
        assert any(m.startswith("tune-parallelism: knee ") for m in logs), logs
    finally:
        proc.terminate()
        proc.wait(30)
