"""Shared run fixtures: a slow simulator, a 1,200-row input and its uninterrupted reference dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import ROWS, run_args
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import Service, spawn_simulator


@pytest.fixture(scope="session")
def slow_sim() -> Service:
    """Slow enough (16 slots x 20 ms = 800 rollouts/s) that a run lasts a few seconds."""
    sim = spawn_simulator("--latency-ms", "20", "--slots", "16")
    yield sim
    sim.stop()


@pytest.fixture(scope="session")
def rows_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rows(tmp_path_factory.mktemp("resume") / "rows.jsonl", ROWS)


@pytest.fixture(scope="session")
def reference(
    run_cli, slow_sim: Service, rows_input: Path, tmp_path_factory: pytest.TempPathFactory
) -> bytes:
    out = tmp_path_factory.mktemp("reference") / "out"
    res = run_cli(*run_args(rows_input, str(out), slow_sim))
    assert res.returncode == 0, res.stderr
    data = (out / "rollouts.jsonl").read_bytes()
    assert_complete(data.splitlines(), ROWS, 2)
    return data
