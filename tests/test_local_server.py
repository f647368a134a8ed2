"""No PREFECT_API_URL: a lasting local Prefect server is started once (Prefect's `server start --background`)
and reused by later runs, whose flow runs all show in its UI; `ephemeral` keeps Prefect's temporary server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.infra.local import Service, free_port
from tests.fixtures_prefect import RunCli, home_with_db
from tests.rollout_data import write_rows

STARTED = "started a Prefect server that stays for later runs"


def answers(api: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _stop(env: dict[str, str], home: Path) -> None:
    """`prefect server stop`, then make sure the process it named is gone (bounded, then killed)."""
    pid_file = home / "server.pid"
    text = pid_file.read_text().strip() if pid_file.exists() else ""
    prefect = str(Path(sys.executable).with_name("prefect"))
    subprocess.run([prefect, "server", "stop"], env=env, capture_output=True, timeout=120)
    if not text:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(int(text), 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(int(text), signal.SIGKILL)


@pytest.fixture
def no_api(tmp_path: Path, cli_env: dict[str, str], prefect_db: Path) -> Iterator[dict[str, str]]:
    """No API URL; a PREFECT_HOME whose database exists (as after a first start) and a free port as the
    profile's server address. Any server started there is stopped at teardown."""
    yield from _no_api(home_with_db(tmp_path / "prefect-home", prefect_db), cli_env)


@pytest.fixture
def new_home(tmp_path: Path, cli_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """As `no_api`, with nothing in PREFECT_HOME: a new machine's first start, which creates the database."""
    yield from _no_api(tmp_path / "prefect-home", cli_env)


def _no_api(home: Path, cli_env: dict[str, str]) -> Iterator[dict[str, str]]:
    port = free_port()
    env = {
        "PREFECT_API_URL": "",
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    yield env
    _stop({**cli_env, **env}, home)


def _collect(run_cli: RunCli, where: Path, sim: Service, env: dict[str, str]):
    where.mkdir()
    inp = write_rows(where / "in.jsonl", 5)
    out = where / "out"
    args = ["collect", "--input", str(inp), "--output", str(out), "--backend-kind", "agent"]
    args += ["--backend-url", sim.url, "--parallelism", "4", "--no-progress"]
    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads((out / "report.json").read_text())


def _flow_runs(api: str) -> int:
    req = urllib.request.Request(f"{api}/flow_runs/count", data=b"{}", method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.read())


def test_local_server_is_started_once_and_kept(
    run_cli: RunCli, new_home: dict[str, str], fast_sim: Service, tmp_path: Path
) -> None:
    no_api = new_home
    api = f"http://127.0.0.1:{no_api['PREFECT_SERVER_API_PORT']}/api"
    first, report = _collect(run_cli, tmp_path / "first", fast_sim, no_api)
    assert STARTED in first.stderr and api.removesuffix("/api") in first.stderr
    assert report["prefect_api"] == "local server, started"
    assert answers(api, timeout_s=5), "the server should outlive the command that started it"
    assert (Path(no_api["PREFECT_HOME"]) / "server.pid").read_text().strip().isdigit()
    second, report = _collect(run_cli, tmp_path / "second", fast_sim, no_api)
    assert STARTED not in second.stderr
    assert report["prefect_api"] == "local server"
    assert _flow_runs(api) == 2
    # it runs the services rollflow uses, and not those it does not (an idle loop costs part of a core)
    with urllib.request.urlopen(f"{api}/admin/settings", timeout=10) as resp:
        services = json.loads(resp.read())["server"]["services"]
    assert [services[s]["enabled"] for s in ("triggers", "foreman", "repossessor", "pause_expirations")] == [
        False
    ] * 4, services
    assert services["scheduler"]["enabled"] and services["task_run_recorder"]["enabled"], services


def test_the_kept_server_stops_when_idle_and_the_next_run_starts_it(
    run_cli: RunCli, no_api: dict[str, str], fast_sim: Service, tmp_path: Path
) -> None:
    """The kept server burned 8-12% of a core while idle, for as long as it lived."""
    api = f"http://127.0.0.1:{no_api['PREFECT_SERVER_API_PORT']}/api"
    env = {**no_api, "ROLLFLOW_PREFECT__IDLE_STOP_S": "4"}
    first, _ = _collect(run_cli, tmp_path / "first", fast_sim, env)
    assert "it stops after 4 s idle" in first.stderr, first.stderr
    deadline = time.monotonic() + 120
    while answers(api) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not answers(api), "the idle server did not stop"
    assert not (Path(no_api["PREFECT_HOME"]) / "server.pid").exists()
    second, report = _collect(
        run_cli, tmp_path / "second", fast_sim, {**env, "ROLLFLOW_PREFECT__IDLE_STOP_S": "0"}
    )
    assert STARTED in second.stderr and "idle" not in second.stderr.split(STARTED)[1].split(")")[0]
    assert report["prefect_api"] == "local server, started" and _flow_runs(api) == 2


def test_ephemeral_setting_keeps_no_server(
    run_cli: RunCli, no_api: dict[str, str], fast_sim: Service, tmp_path: Path
) -> None:
    env = {**no_api, "ROLLFLOW_PREFECT__LOCAL_SERVER": "ephemeral"}
    done, report = _collect(run_cli, tmp_path / "run", fast_sim, env)
    assert report["prefect_api"] == "ephemeral" and STARTED not in done.stderr
    assert not answers(f"http://127.0.0.1:{no_api['PREFECT_SERVER_API_PORT']}/api")
    assert not (Path(no_api["PREFECT_HOME"]) / "server.pid").exists()


def test_a_port_taken_by_something_else_gets_this_home_its_own_server(
    run_cli: RunCli, no_api: dict[str, str], fast_sim: Service, tmp_path: Path
) -> None:
    """A stranger on the profile's port (a socket that never answers, then another home's Prefect API that
    does): the runs go to this PREFECT_HOME's own kept server, on another port, never the stranger."""
    with socket.socket() as squatter:  # listens, never answers HTTP: not a Prefect server
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = {**no_api, "PREFECT_SERVER_API_PORT": str(port)}
        done, report = _collect(run_cli, tmp_path / "run", fast_sim, env)
        assert f"127.0.0.1:{port} is taken" in done.stderr and STARTED in done.stderr, done.stderr
        assert report["prefect_api"] == "local server, started"
    home = Path(no_api["PREFECT_HOME"])
    ours = int((home / "rollflow-server.port").read_text())
    assert ours != port and answers(f"http://127.0.0.1:{ours}/api", timeout_s=5)
    assert _flow_runs(f"http://127.0.0.1:{ours}/api") == 1


def test_another_homes_server_on_the_port_is_not_adopted(
    run_cli: RunCli, no_api: dict[str, str], fast_sim: Service, tmp_path: Path, prefect_server: Service
) -> None:
    stranger = prefect_server.env["PREFECT_API_URL"]
    before = _flow_runs(stranger)
    port = stranger.rsplit(":", 1)[1].split("/")[0]
    env = {**no_api, "PREFECT_SERVER_API_PORT": port}
    done, report = _collect(run_cli, tmp_path / "run", fast_sim, env)
    assert f"127.0.0.1:{port} is taken" in done.stderr and report["prefect_api"] == "local server, started"
    ours = int((Path(no_api["PREFECT_HOME"]) / "rollflow-server.port").read_text())
    assert _flow_runs(f"http://127.0.0.1:{ours}/api") == 1
    assert _flow_runs(stranger) == before, "the run went into another PREFECT_HOME's database"


def test_bad_local_server_setting_is_one_paragraph(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from rollflow.flows.cli.main import main

    monkeypatch.setenv("ROLLFLOW_PREFECT__LOCAL_SERVER", "forever")
    inp = write_rows(tmp_path / "in.jsonl", 2)
    status = main(["collect", "--input", str(inp), "--output", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and "ROLLFLOW_PREFECT__LOCAL_SERVER" in err and "'keep' or 'ephemeral'" in err
    assert not (tmp_path / "out").exists()


def test_pid_file_of_a_server_that_never_answers(tmp_path: Path) -> None:
    """A PID file naming a live process that does not answer: no second server, and a clear way out."""
    from rollflow.flows.cli.local_server import LocalServer, LocalServerError

    stand_in = _prefect_stand_in()
    try:
        (tmp_path / "server.pid").write_text(str(stand_in.pid))
        server = LocalServer(tmp_path, free_port())
        assert server.start() is False
        with pytest.raises(LocalServerError, match="prefect server stop"):
            server.wait(timeout_s=0.5)
    finally:
        stand_in.kill()
        stand_in.wait()


def _prefect_stand_in() -> subprocess.Popen[bytes]:
    """A live process whose command line says prefect, as a kept server's does (it answers nothing)."""
    return _started([sys.executable, "-c", "import time; time.sleep(60)", "prefect", "server"])


def _started(argv: list[str]) -> subprocess.Popen[bytes]:
    """A process once its command line is readable (empty until its exec is done)."""
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_a_pid_file_and_port_file_never_adopt_what_is_not_this_homes_server(
    tmp_path: Path, prefect_server: Service
) -> None:
    """A PID reused by another process (after a reboot), or a recorded port now served by another home's
    server: rollflow sent its runs into that stranger's database and exited 0."""
    from rollflow.flows.cli.local_server import owned_port

    stranger_port = int(prefect_server.env["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    (tmp_path / "rollflow-server.port").write_text(str(stranger_port))
    sleeper = _started([sys.executable, "-c", "import time; time.sleep(60)"])
    stand_in = _prefect_stand_in()
    try:
        (tmp_path / "server.pid").write_text(str(sleeper.pid))
        assert owned_port(tmp_path, free_port()) is None, "a reused PID is no server of this home"
        (tmp_path / "server.pid").write_text(str(stand_in.pid))
        assert owned_port(tmp_path, free_port()) is None, "another home's server on the recorded port"
        (tmp_path / "rollflow-server.port").write_text(str(free_port()))
        assert owned_port(tmp_path, 1) is not None, "this home's server, still starting"
    finally:
        for proc in (sleeper, stand_in):
            proc.kill()
            proc.wait()


def test_the_demo_takes_the_kept_server_path_under_load(
    run_cli: RunCli, new_home: dict[str, str], tmp_path: Path
) -> None:
    """`rollflow demo` with no API configured, two busy processes beside it: it starts this home's kept
    server (no 20-s ephemeral start limit) and says what it waits for; never a traceback."""
    no_api = new_home  # a new machine's first start: creating the database is what outran the limit
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        done = run_cli(
            "demo", "--output", str(tmp_path / "demo-out"), "--num-repeats", "2", env=no_api, timeout=600
        )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(10)
    assert done.returncode == 0, done.stderr[-3000:]
    assert STARTED in done.stderr and "waiting for it to answer" in done.stderr
    assert "Traceback" not in done.stderr and "ephemeral Prefect API server" not in done.stderr
    report = json.loads((tmp_path / "demo-out" / "report.json").read_text())
    assert report["prefect_api"] == "local server, started" and report["published"]


def test_a_prefect_home_that_is_a_file_is_one_paragraph(
    run_cli: RunCli, new_home: dict[str, str], tmp_path: Path
):
    """A PREFECT_HOME that is a regular file ended in FileExistsError's traceback."""
    no_api = new_home
    home = Path(no_api["PREFECT_HOME"])
    home.write_text("not a folder")
    inp = write_rows(tmp_path / "in.jsonl", 2)
    res = run_cli(
        "run",
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
        env=no_api,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"PREFECT_HOME {home}" in res.stderr and "it is a file, not a folder" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
