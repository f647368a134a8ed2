"""A real Prefect server for the session, and a way to run the `rollflow` CLI against it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollflow.infra.local import Service, spawn_prefect_server

RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    server = spawn_prefect_server(
        home=str(tmp_path_factory.mktemp("prefect-home")),
        settings={"PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": "5"},  # schedule tests wait less
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
