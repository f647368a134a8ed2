"""A real NeMo Gym 0.7.0 stack (infra/nemo_gym): installed on first use, started once per session (worker)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures_net import free_port

from rollflow.infra.nemo_gym.stack import Stack, start_stack

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "infra" / "nemo_gym" / "install.sh"
INSTALL_TIMEOUT_S = 1800  # a fresh machine downloads NeMo Gym and its dependencies (ray, mlflow, ...)


@pytest.fixture(scope="session")
def nemo_gym_venv() -> Path:
    """The NeMo Gym venv, installed by install.sh if missing (never skipped: a fresh machine installs it)."""
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, f"install.sh failed ({done.returncode}):\n{done.stderr[-4000:]}"
    venv = Path(done.stdout.strip().splitlines()[-1])
    assert (venv / "bin" / "gym").exists(), f"install.sh printed {venv}, which has no bin/gym"
    return venv


@pytest.fixture(scope="session")
def ng_bin(nemo_gym_venv: Path) -> Callable[[str], Path]:
    """The path of a NeMo Gym command in its venv, e.g. ng_bin("ng_collect_rollouts")."""

    def path(name: str) -> Path:
        found = nemo_gym_venv / "bin" / name
        assert found.exists(), f"no {name} in {nemo_gym_venv / 'bin'}"
        return found

    return path


@pytest.fixture(scope="session")
def nemo_gym_stack(nemo_gym_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Head server on a free port (never NeMo Gym's 11000, tests run in parallel); agent_a, agent_b."""
    stack = start_stack(tmp_path_factory.mktemp("nemo_gym"), free_port(), venv=nemo_gym_venv)
    try:
        yield stack
    finally:
        stack.stop()
