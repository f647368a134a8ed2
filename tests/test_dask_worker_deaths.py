"""A chunk that kills its worker process on every attempt: Dask gives up on it after its allowed failures,
and the flow does not retry it once more (each retry cost as many workers again); the run ends with the
chunk's error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures_dask import own_cluster
from rollout_data import write_rows

TESTS = str(Path(__file__).parent)
pytestmark = pytest.mark.concurrent


def test_a_chunk_that_kills_its_worker_is_not_retried_past_the_engines_attempts(
    run_cli, cli_env, fast_sim, tmp_path: Path
) -> None:
    deaths = tmp_path / "deaths"
    env = {
        **cli_env,
        "PYTHONPATH": os.pathsep.join([TESTS, cli_env.get("PYTHONPATH", "")]),
        "ROLLFLOW_TEST_DEATHS": str(deaths),
        "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1",  # Dask gives up after 2 deaths
    }
    inp, out = write_rows(tmp_path / "rows.jsonl", 80), tmp_path / "out"
    with own_cluster(env, workers=2, preloads=("worker_faults",)) as cluster:
        args = ["run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
                "--backend-url", fast_sim.url, "--chunk-size", "20", "--parallelism", "8", "--no-progress",
                "--runner", "dask", "--dask-address", cluster.address]  # fmt: skip
        res = run_cli(*args, timeout=240)
    died = deaths.read_text().split() if deaths.exists() else []
    assert res.returncode == 1, res.stderr[-3000:]
    assert len(died) == 2, f"chunk 0 killed {len(died)} worker processes: {died}"
    assert "WorkerLost" in res.stderr and "died on each of Dask's attempts" in res.stderr, res.stderr[-3000:]
    # A chunk that shared a dying worker each time is given up too (Dask's KilledWorker names it as well);
    # the others are committed.
    committed = sorted(p.name for p in out.glob("chunks/*.json"))
    assert committed and "00000.json" not in committed, committed
