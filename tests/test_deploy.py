"""infra/: prefect.yaml deploys onto a process work pool and a worker runs it; the compose file and
local-up are what the README says they are."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
import yaml
from rollout_data import assert_complete, write_rows

from rollflow.flows.serve import default_parameters
from rollflow.infra.local import wait_http
from rollflow.settings import RollflowSettings

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))


def api(server_url: str, path: str, body: dict | None = None) -> object:
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(
        f"{server_url}/api{path}", data=data, headers={"Content-Type": "application/json"}
    )
    return orjson.loads(urllib.request.urlopen(req, timeout=30).read())


def test_prefect_yaml_entrypoints_are_rollflow_flows() -> None:
    from prefect.flows import load_flow_from_entrypoint

    doc = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    assert doc["pull"] == [], "no pull step: a worker must not depend on the deploying machine's paths"
    names = {load_flow_from_entrypoint(d["entrypoint"]).name for d in doc["deployments"]}
    assert names == {"rollflow-run", "rollflow-diagnose", "rollflow-tune", "rollflow-reverify"}
    assert all(d["work_pool"]["name"] == "rollflow" for d in doc["deployments"])


def test_compose_file_has_the_production_services_and_no_literal_secrets() -> None:
    doc = yaml.safe_load((REPO / "infra" / "compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "prefect", "minio", "worker"} <= set(services)
    assert (
        "postgresql+asyncpg://" in services["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    )
    worker_env = services["worker"]["environment"]
    assert worker_env["PREFECT_API_URL"] == "http://prefect:4200/api"
    for key in ("AWS_SECRET_ACCESS_KEY", "ROLLFLOW_BACKEND__API_KEY"):
        assert worker_env[key].startswith("${"), f"{key} must come from the caller's environment"


def test_prefect_deploy_then_a_process_worker_runs_it(cli_env, prefect_server, fast_sim, tmp_path) -> None:
    """`prefect deploy --all` onto a process pool, then `prefect worker start --run-once` elsewhere."""
    env = {**cli_env, "PREFECT_LOGGING_LEVEL": "WARNING"}
    pool = subprocess.run(
        [PREFECT, "work-pool", "create", "rollflow", "--type", "process"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert pool.returncode == 0 or "already exists" in pool.stdout + pool.stderr, pool.stderr
    deploy = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert deploy.returncode == 0, deploy.stdout[-2000:] + deploy.stderr[-2000:]
    deployment = api(prefect_server.url, "/deployments/name/rollflow-run/rollflow")
    assert deployment["work_pool_name"] == "rollflow" and deployment["pull_steps"] == []
    assert [s["active"] for s in deployment["schedules"]] == [False], "nightly schedule starts paused"
    schema = deployment["parameter_openapi_schema"]
    assert {"input", "output", "backend", "collection", "verify"} <= set(schema["properties"])
    assert "CollectionSettings" in schema["definitions"]
    for flow in ("rollflow-diagnose", "rollflow-tune"):
        api(prefect_server.url, f"/deployments/name/{flow}/rollflow")

    inp = write_rows(tmp_path / "rows.jsonl", 60)
    out = tmp_path / "worker-out"
    spec = {"input": str(inp), "output": str(out), "backend": {"kind": "agent", "url": fast_sim.url}}
    spec["collection"] = {"parallelism": 8, "chunk_size": 20}
    params = orjson.dumps(spec).decode()
    trigger = subprocess.run(
        [PREFECT, "deployment", "run", "rollflow-run/rollflow", "--params", params],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert trigger.returncode == 0, trigger.stdout + trigger.stderr
    elsewhere = tmp_path / "worker-home"  # not the repository: the module entrypoint is enough
    elsewhere.mkdir()
    worker = subprocess.run(
        [PREFECT, "worker", "start", "--pool", "rollflow", "--run-once"],
        env=env, capture_output=True, text=True, timeout=180, cwd=elsewhere,
    )  # fmt: skip
    assert worker.returncode == 0, worker.stdout[-2000:] + worker.stderr[-2000:]
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 60, 1)


def test_default_parameters_without_input_keep_the_other_settings(monkeypatch) -> None:
    """Serving without input/output: the form shows the settings' backend and asks for the rest."""
    monkeypatch.setenv("ROLLFLOW_BACKEND__URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ROLLFLOW_BACKEND__API_KEY", "sk-never-a-parameter")
    monkeypatch.delenv("ROLLFLOW_PIPELINE__INPUT", raising=False)
    monkeypatch.delenv("ROLLFLOW_PIPELINE__OUTPUT", raising=False)
    spec = default_parameters(RollflowSettings(_env_file=None))
    assert "input" not in spec and "output" not in spec
    assert spec["backend"]["url"] == "http://127.0.0.1:9"
    assert "sk-never" not in orjson.dumps(spec).decode()


def test_serve_refuses_a_schedule_without_input(run_cli) -> None:
    done = run_cli("serve", "--cron", "0 2 * * *", timeout=60)
    assert done.returncode == 2
    assert "ROLLFLOW_PIPELINE__INPUT" in done.stderr


def test_local_up_prints_urls_and_stops_on_ctrl_c() -> None:
    """`python -m rollflow.infra.local up` (what infra/local-up.sh runs): three servers, gone on SIGINT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflow.infra.local", "up"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        exports = dict(re.findall(r"export (\w+)=(\S+)", text))
        assert {"PREFECT_API_URL", "AWS_ENDPOINT_URL", "ROLLFLOW_BACKEND__URL"} <= set(exports), text
        urls = [exports["PREFECT_API_URL"] + "/health", exports["AWS_ENDPOINT_URL"]]
        urls.append(exports["ROLLFLOW_BACKEND__URL"] + "/health")
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        for url in urls:
            wait_http(url, 10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for url in urls:
            with pytest.raises(OSError):
                urllib.request.urlopen(url, timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_section_given_in_part_keeps_its_other_fields_as_served(monkeypatch) -> None:
    """What a run gives of a section (an explicit null included) replaces only those fields."""
    from rollflow.flows.parameters import run_spec
    from rollflow.flows.pipeline import rollflow_run

    served = {"COLLECTION__NUM_REPEATS": "2", "COLLECTION__LIMIT": "10", "BACKEND__MODEL": "m"}
    for key, value in served.items():
        monkeypatch.setenv(f"ROLLFLOW_{key}", value)
    given = {"input": "rows.jsonl", "output": "out", "collection": {"limit": None, "chunk_size": 7}}
    spec = run_spec(rollflow_run.validate_parameters(given), RollflowSettings(_env_file=None))
    assert (spec.collection.limit, spec.collection.chunk_size) == (None, 7)
    assert (spec.collection.num_repeats, spec.backend.model) == (2, "m")


def test_local_up_whose_prefect_server_is_slow_says_so_in_one_paragraph(tmp_path: Path) -> None:
    """`make up` ended in `TimeoutError: .../api/health did not answer within 90s` and its traceback; the
    wait follows ROLLFLOW_PREFECT__START_TIMEOUT_S (a loaded machine needs longer) and says what to do."""
    env = {**os.environ, "ROLLFLOW_PREFECT__START_TIMEOUT_S": "0.2", "PREFECT_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "rollflow.infra.local", "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "did not answer within 0.2s" in done.stderr and "ROLLFLOW_PREFECT__START_TIMEOUT_S" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
