"""Runs on one long-lived Dask cluster: each run's share book state is its own and gone when it ends."""

from __future__ import annotations

import json
import time

from cli_runs import run_args, spawn, wait_until
from fixtures_dask import reset_stats, sim_stats

from rollflow.infra.local import free_port, spawn_simulator
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


def test_a_replica_out_of_rotation_leaves_the_whole_limit_on_the_others(
    cli_env, dask_cluster, moto_s3, rows_input, tmp_path
):
    """--parallelism 16 over a dead replica and a live one (8 + 8), two workers: with the dead one out,
    the live one gets the run's 8, not 4 (each worker's share used to be spread over both, an odd unit to
    the dead one listed first, and capped at the part on the live one)."""
    sim = spawn_simulator("--latency-ms", "20", "--slots", "32")
    out = tmp_path / "out"
    try:
        args = [*run_args(rows_input, str(out), sim), "--backend-url", f"http://127.0.0.1:{free_port()},{sim.url}",
                "--runner", "dask", "--dask-address", dask_cluster.address, "--limit", "600"]  # fmt: skip
        proc = spawn(args, {**cli_env, **moto_s3.env})
        wait_until(lambda: len(list(out.glob("chunks/*.json"))) >= 1, proc, timeout_s=120)
        # While the dead one is being found: the live one's 8, plus at most one attempt per worker whose
        # part of it is 0 fixed slots (such an endpoint still takes attempts: see split_limit); all 16 of
        # the run on it at once would be twice its limit.
        early = sim_stats(sim)["max_in_flight_seen"]
        reset_stats(sim)  # from here on, the dead replica is out for every worker
        assert proc.wait(120) == 0, proc.stderr.read().decode()[-3000:]
        seen = sim_stats(sim)["max_in_flight_seen"]
    finally:
        sim.stop()
    assert early <= 8 + 2 and 4 < seen <= 8, f"{early}, then {seen} requests at once on the live replica"


def test_two_runs_at_once_on_one_cluster_each_count_their_own(
    cli_env, dask_cluster, moto_s3, rows_input, tmp_path
):
    """Two runs share the cluster's worker processes, and their chunks have the same indexes: each run's
    demand and progress count its own rollouts only (another run's made a run's demand read 0 while its
    chunk still had work; the book granted it 0 and its tail hung)."""
    sim = spawn_simulator("--latency-ms", "20", "--slots", "32")
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    try:
        for out in outs:
            args = [*run_args(rows_input, str(out), sim), "--runner", "dask", "--dask-address",
                    dask_cluster.address, "--parallelism", "8", "--limit", "400"]  # fmt: skip
            procs.append(spawn(args, {**cli_env, **moto_s3.env}))
        for proc in procs:
            assert proc.wait(90) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        sim.stop()
    for out in outs:
        assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 2 * 400
        report = json.loads((out / "report.json").read_text())
        assert sum(w["rollouts"] for w in report["workers"]) == 2 * 400, report["workers"]
