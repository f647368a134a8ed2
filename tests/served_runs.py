"""`rollflow serve` in a subprocess, and the Prefect API calls the served-run tests make of it."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

RETRIES_503 = 10
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def serve(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    """`rollflow serve` with the runner looking for new runs every second (10 s by default)."""
    exe = str(Path(sys.executable).with_name("rollflow"))
    return subprocess.Popen(
        [exe, "serve", *args], env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def call(api: str, path: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    """(HTTP status, JSON body) of one Prefect API call; `api` ends in /api.

    A 503 (SQLite busy under load) is tried again, as Prefect's own client does.
    """
    data = orjson.dumps(body) if body is not None else None
    for _ in range(RETRIES_503):
        req = urllib.request.Request(
            f"{api}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
                return resp.status, orjson.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            status, found = exc.code, orjson.loads(exc.read() or b"{}")
        if status != 503:
            break
        time.sleep(1)
    return status, found


def ok(api: str, path: str, body: Any = None, method: str | None = None) -> Any:
    status, found = call(api, path, body, method)
    assert status < 300, f"{method or ('POST' if body is not None else 'GET')} {path}: {status} {found}"
    return found


def deployment(api: str, name: str, proc: subprocess.Popen[bytes], timeout_s: float = 90) -> dict:
    """The served deployment rollflow-run/NAME, once `rollflow serve` has registered it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, found = call(api, f"/deployments/name/rollflow-run/{name}")
        if status == 200:
            return found
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else "serve exited"
        time.sleep(0.5)
    raise AssertionError(f"rollflow serve did not register rollflow-run/{name} within {timeout_s} s")


def wait_final(api: str, run_id: str, timeout_s: float = 180) -> dict:
    """The flow run once it is completed, failed, crashed or cancelled."""
    deadline = time.monotonic() + timeout_s
    run = ok(api, f"/flow_runs/{run_id}")
    while run["state"]["type"] not in FINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        run = ok(api, f"/flow_runs/{run_id}")
    assert run["state"]["type"] in FINAL, (
        f"flow run {run_id} still {run['state']['type']} after {timeout_s} s"
    )
    return run


def start_run(api: str, deployment_id: str, parameters: dict[str, Any]) -> dict:
    return ok(api, f"/deployments/{deployment_id}/create_flow_run", {"parameters": parameters})


def artifacts(api: str, run_id: str) -> dict[str, dict]:
    """The flow run's artifacts by key (the latest of each)."""
    found = ok(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    return {a["key"]: a for a in sorted(found, key=lambda a: a["created"])}


def spec_in_force(report: dict[str, Any]) -> dict[str, Any]:
    """The report's spec without the fields the run fills itself from a head server (none here), which
    are never served."""
    spec = copy.deepcopy(report["spec"])
    filled = {name: spec["backend"].pop(name) for name in ("agents", "sources")}
    assert filled == {"agents": {}, "sources": {}}, filled
    return spec
