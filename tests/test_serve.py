"""Served deployments: a schedule runs by itself and publishes; bad parameters are refused."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows

ROWS = 200


@pytest.fixture(scope="module")
def served(cli_env, fast_sim, tmp_path_factory) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`rollflow serve` with an every-15-s schedule whose defaults come from ROLLFLOW_* settings."""
    work = tmp_path_factory.mktemp("served")
    inp = write_rows(work / "rows.jsonl", ROWS)
    out = work / "scheduled-out"
    env = {
        **cli_env,
        "ROLLFLOW_PIPELINE__INPUT": str(inp),
        "ROLLFLOW_PIPELINE__OUTPUT": str(out),
        "ROLLFLOW_BACKEND__KIND": "agent",
        "ROLLFLOW_BACKEND__URL": fast_sim.url,
        "ROLLFLOW_COLLECTION__PARALLELISM": "16",
        "PREFECT_RUNNER_POLL_FREQUENCY": "5",
    }
    exe = str(Path(sys.executable).with_name("rollflow"))
    proc = subprocess.Popen(
        [exe, "serve", "--name", "test", "--interval-s", "15"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    yield proc, out
    proc.terminate()
    proc.wait(30)


def test_schedule_runs_by_itself_and_publishes(served) -> None:
    proc, out = served
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not (out / "rollouts.jsonl").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(1)
    assert (out / "rollouts.jsonl").exists(), "the scheduled run did not publish within 150 s"
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), ROWS, 1)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"collection": {"parallelism": -1}}, "parallelism"),
        ({"backend": {"kind": "grpc"}}, "kind"),
        ({"verify": {"verifier": "fuzzy"}}, "verifier"),
    ],
)
def test_bad_parameters_are_refused(served, prefect_server, tmp_path, change, needle) -> None:
    api = prefect_server.env["PREFECT_API_URL"]
    out = tmp_path / "never-written"
    spec = {"input": "rows.jsonl", "output": str(out), **change}

    def call(path: str, body: dict | None = None) -> tuple[int, dict]:
        data = orjson.dumps(body) if body is not None else None
        req = urllib.request.Request(f"{api}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, orjson.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, orjson.loads(exc.read() or b"{}")

    status, deployment = call("/deployments/name/rollflow-run/test")
    for _ in range(60):  # when run alone, serve may still be registering its deployments
        if status == 200:
            break
        time.sleep(1)
        status, deployment = call("/deployments/name/rollflow-run/test")
    status, run = call(f"/deployments/{deployment['id']}/create_flow_run", {"parameters": {"spec": spec}})
    if status < 300:  # accepted by the API: then the flow itself must refuse it
        for _ in range(120):
            _, run = call(f"/flow_runs/{run['id']}")
            if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(1)
        outcome = f"{run['state']['type']}: {run['state']['message']}"
        assert run["state"]["type"] == "FAILED", outcome
    else:
        outcome = f"refused {status}: {run}"
        assert status in (409, 422), outcome
    assert needle in outcome
    assert not out.exists(), "a refused run must write nothing"
