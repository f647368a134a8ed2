"""A real Prefect server for the session, and a way to run the `rollflow` CLI against it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from filelock import FileLock

from rollflow.flows.cli.local_server import SERVICES_OFF
from rollflow.infra.local import Service, spawn_prefect_server

RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def prefect_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Prefect database with every migration applied, made once per session for all xdist workers: a
    home that is not testing the first start copies it (Prefect's migrations cost ~8 CPU-s a home)."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    db = shared / f"prefect-{version('prefect')}.db"
    with FileLock(str(db) + ".lock"):
        if not db.exists():
            home = shared / "prefect-db-home"
            env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            for name in ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
                env.pop(name, None)  # the migrations go to this home's SQLite file
            prefect = str(Path(sys.executable).with_name("prefect"))
            made = subprocess.run(
                [prefect, "server", "database", "upgrade", "-y"],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
            (home / "prefect.db").replace(db)
    return db


def home_with_db(home: Path, db: Path) -> Path:
    """`home` holding a copy of the migrated database, as after a first start."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(db, home / "prefect.db")
    return home


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory, prefect_db: Path) -> Iterator[Service]:
    server = spawn_prefect_server(
        home=str(home_with_db(tmp_path_factory.mktemp("prefect-home"), prefect_db)),
        # the services the kept local server runs (a user's runs see the same), the scheduler quicker
        settings={**SERVICES_OFF, "PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": "5"},
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cli_env(prefect_server: Service) -> dict[str, str]:
    """The environment a user's shell would have: the Prefect API URL and no stray ROLLFLOW_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLFLOW_")}
    env.update(prefect_server.env)
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env


@pytest.fixture(scope="session")
def run_cli(cli_env: dict[str, str]) -> RunCli:
    exe = str(Path(sys.executable).with_name("rollflow"))

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: str | None = None):
        return subprocess.run(
            [exe, *args],
            env={**cli_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )

    return run
