"""Runs on one long-lived Dask cluster: each run's share book state is its own and gone when it ends."""

from __future__ import annotations

import time

from cli_runs import run_args, spawn

from rollflow.tasks.scaleout.channels import PREFIX


def test_a_run_leaves_nothing_on_the_scheduler_and_its_workers_stop_reporting(
    cli_env, dask_cluster, moto_s3, slow_sim, rows_input, tmp_path
):
    """Once the run ends its key is deleted from the scheduler's metadata (not left as {}), and no worker
    writes it back: they stop reporting within a second, not after 30 s idle."""
    from distributed import Client

    def _collector_slots() -> int:  # runs on each worker (pickled by value)
        from rollflow.tasks.scaleout.collector import WorkerCollector

        return len(WorkerCollector._instance.slots) if WorkerCollector._instance else 0

    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), slow_sim), "--runner", "dask", "--dask-address",
            dask_cluster.address, "--limit", "200"]  # fmt: skip
    proc = spawn(args, {**cli_env, **moto_s3.env})
    assert proc.wait(120) == 0, proc.stderr.read().decode()[-3000:]
    with Client(dask_cluster.address, timeout=30) as client:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(client.run(_collector_slots).values()):
            time.sleep(0.05)
        assert not any(client.run(_collector_slots).values()), "a worker still reports for the ended run"
        time.sleep(0.5)
        assert client.get_metadata([PREFIX], None) is None
