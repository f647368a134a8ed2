"""A run's fixed cost shows in its report, its progress shows in logs, and a running server is reused."""

from __future__ import annotations

import json
import re
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

from rollflow.infra.local import Service
from tests.fixtures_prefect import RunCli
from tests.rollout_data import write_rows

PROGRESS = re.compile(r"^rollflow: collect (\d+)/(\d+) rollouts \(\d+%\), [\d,.]+ rollouts/s", re.M)


def _collect(run_cli: RunCli, tmp_path: Path, sim: Service, *extra: str, env: dict[str, str] | None = None):
    inp = write_rows(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"
    args = ["collect", "--input", str(inp), "--output", str(out), "--backend-kind", "agent"]
    args += ["--backend-url", sim.url, "--num-repeats", "2", "--parallelism", "8", *extra]
    return run_cli(*args, env=env), out


def test_progress_lines_when_not_a_terminal(run_cli: RunCli, fast_sim: Service, tmp_path: Path) -> None:
    done, out = _collect(run_cli, tmp_path, fast_sim)
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stderr.splitlines()[0]
    assert first == (
        f"rollflow: run started: output {out}, backend agent {fast_sim.url}, input {tmp_path / 'in.jsonl'}"
    )
    assert "rollflow: 40 rollouts planned" in done.stderr
    lines = PROGRESS.findall(done.stderr)
    assert lines and lines[-1] == ("40", "40")
    assert [int(d) for d, _ in lines] == sorted(int(d) for d, _ in lines)


def test_no_progress_lines_with_no_progress(run_cli: RunCli, fast_sim: Service, tmp_path: Path) -> None:
    done, _ = _collect(run_cli, tmp_path, fast_sim, "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run started" not in done.stderr and not PROGRESS.search(done.stderr)


def test_report_times_startup_and_shutdown(run_cli: RunCli, fast_sim: Service, tmp_path: Path) -> None:
    done, out = _collect(run_cli, tmp_path, fast_sim, "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["startup_s"] == report["stages"]["startup"] > 0
    assert 0 < report["before_flow_s"] <= report["startup_s"] <= report["wall_s"]
    assert report["shutdown_s"] is not None and 0 <= report["shutdown_s"] < report["wall_s"]
    assert 0 < report["prefect_overhead_share"] < 1
    assert report["prefect_api"] == "configured"


def test_a_jsonl_run_imports_only_what_it_uses(run_cli: RunCli, fast_sim: Service, tmp_path: Path) -> None:
    """A JSONL collect on the local runner imports no pyarrow (Parquet), huggingface_hub (the card is
    written without it), matplotlib (the reward histogram is drawn with Pillow; tuning and control plots,
    not drawn here, keep it), FastAPI (the flow's parameters are encoded without it), Dask or Ray:
    Python's own import log (-X importtime) lists every module."""
    done, out = _collect(run_cli, tmp_path, fast_sim, "--no-progress", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "README.md").exists() and (out / "rewards.png").exists()
    imported = {
        line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert "PIL.PngImagePlugin" in imported and "rollflow.flows.pipeline" in imported, "the log is the run's"
    roots = {name.split(".")[0] for name in imported}
    unused = roots & {
        "pyarrow",
        "huggingface_hub",
        "matplotlib",
        "fastapi",
        "dask",
        "distributed",
        "ray",
        "prefect_dask",
    }
    assert not unused, unused


def _runs_writing(api: str, out: Path, since: str) -> list[str]:
    """Names of the flows whose runs, started after `since`, were given `out` as their output.

    Matched by parameter, not counted server-wide: other tests' runs may land on the shared server.
    """

    def post(path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    flows = {f["id"]: f["name"] for f in post("/flows/filter", {})}
    runs = post("/flow_runs/filter", {"flow_runs": {"start_time": {"after_": since}}, "limit": 200})
    return [flows[r["flow_id"]] for r in runs if r["parameters"].get("output") == str(out)]


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _home_of(api: str) -> str:
    """The PREFECT_HOME the server runs with: a run finds the server of its own home only."""
    with urllib.request.urlopen(f"{api}/admin/settings", timeout=10) as resp:
        return json.loads(resp.read())["home"]


def test_running_local_server_is_reused(
    run_cli: RunCli, cli_env: dict[str, str], prefect_server: Service, fast_sim: Service, tmp_path: Path
) -> None:
    """No PREFECT_API_URL: the server of this PREFECT_HOME answering at the profile's address gets the run."""
    api = prefect_server.env["PREFECT_API_URL"]
    since = _now()
    port = str(urlparse(api).port)
    env = {"PREFECT_API_URL": "", "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": port}
    env["PREFECT_HOME"] = _home_of(api)
    done, out = _collect(run_cli, tmp_path, fast_sim, "--no-progress", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["prefect_api"] == "local server"
    assert _runs_writing(api, out, since) == ["rollflow-run"]


def test_diagnose_uses_the_running_local_server(
    run_cli: RunCli, prefect_server: Service, fast_sim: Service, tmp_path: Path
) -> None:
    """`rollflow diagnose` finds the server at the profile's address like `collect` (its run in that UI)."""
    api = prefect_server.env["PREFECT_API_URL"]
    since = _now()
    port = str(urlparse(api).port)
    env = {"PREFECT_API_URL": "", "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": port}
    env["PREFECT_HOME"] = _home_of(api)
    env["ROLLFLOW_PREFECT__LOCAL_SERVER"] = "ephemeral"  # if it were not found, nothing would be kept
    inp = write_rows(tmp_path / "in.jsonl", 40)
    done = run_cli(
        "diagnose", "--input", str(inp), "--output", str(tmp_path / "out"), "--backend-kind", "agent",
        "--backend-url", fast_sim.url, "--diagnose-rows", "20", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert _runs_writing(api, tmp_path / "out", since) == ["rollflow-diagnose"]
