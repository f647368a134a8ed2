"""Dask workers run no Prefect: each chunk's task run is kept by the flow process, and a worker whose
environment names no Prefect server still reads the Secret block its settings name, from the flow's."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from datetime import datetime
from pathlib import Path

import orjson
import pytest
from fixtures_dask import DaskCluster, own_cluster
from key_server import KeyServer
from prefect_api import flow_runs_of, post
from rollout_data import write_rows

from rollflow.infra.local import spawn_simulator


def worker_host(cli_env: dict[str, str], **settings: str) -> contextlib.AbstractContextManager[DaskCluster]:
    """A scheduler and one worker whose environment has no Prefect settings at all, plus `settings`."""
    env = {k: v for k, v in cli_env.items() if not k.startswith("PREFECT_")}
    return own_cluster({**env, **settings}, workers=1)


def run_args(inp: Path, out: Path, url: str, cluster: DaskCluster, chunk_size: int = 20) -> list[str]:
    return ["run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", url,
            "--chunk-size", str(chunk_size), "--parallelism", "4", "--no-progress", "--runner", "dask",
            "--dask-address", cluster.address]  # fmt: skip


def prefect_on_workers(cluster: DaskCluster) -> dict[str, bool]:
    from distributed import Client

    def loaded() -> bool:  # runs on each worker (pickled by value)
        return "prefect" in sys.modules

    with Client(cluster.address, timeout=30) as client:
        return client.run(loaded)


def chunk_task_runs(api_url: str, output: str) -> dict[str, dict]:
    mine = [r["id"] for r in flow_runs_of(api_url, output)]
    assert len(mine) == 1, "the run's flow run is on the server"
    tasks = post(api_url, "/task_runs/filter", {"flow_runs": {"id": {"any_": mine}}, "limit": 200})
    return {t["name"]: t for t in tasks if t["name"].startswith("chunk-")}


@pytest.mark.concurrent
def test_workers_import_no_prefect_and_the_flow_keeps_each_chunks_task_run(
    run_cli, cli_env, fast_sim, tmp_path: Path
) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 60), tmp_path / "out"
    with worker_host(cli_env) as cluster:
        res = run_cli(*run_args(inp, out, fast_sim.url, cluster))
        loaded = prefect_on_workers(cluster)
    assert res.returncode == 0, res.stderr[-3000:]
    assert loaded and not any(loaded.values()), f"Prefect imported on the workers: {loaded}"
    runs = chunk_task_runs(cli_env["PREFECT_API_URL"], str(out))
    states = {name: run["state"]["type"] for name, run in runs.items()}
    assert states == {f"chunk-0000{i}": "COMPLETED" for i in range(3)}, states


@pytest.mark.alone  # task run starts within 0.5 s of the chunk's
def test_a_chunk_waiting_in_the_clusters_queue_is_not_shown_running(run_cli, cli_env, tmp_path: Path) -> None:
    """12 chunks on one worker with 2 threads: most wait in Dask's queue, seconds apart. Each chunk's task
    run starts when a worker reports the chunk running, not when the flow submitted it (up to 0.5 s
    before the chunk's own start time: the worker reads the chunk's rows between the two)."""
    sim = spawn_simulator("--latency-ms", "200", "--slots", "8")
    inp, out = write_rows(tmp_path / "rows.jsonl", 120), tmp_path / "out"
    try:
        with worker_host(cli_env) as cluster:
            res = run_cli(*run_args(inp, out, sim.url, cluster, chunk_size=10), timeout=240)
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    runs = chunk_task_runs(cli_env["PREFECT_API_URL"], str(out))
    assert len(runs) == 12, sorted(runs)
    early = {}
    for name, run in runs.items():
        manifest = orjson.loads((out / "chunks" / f"{name.removeprefix('chunk-')}.json").read_bytes())
        began = datetime.fromisoformat(manifest["started_at"])
        ahead = (began - datetime.fromisoformat(run["start_time"])).total_seconds()
        if ahead > 0.5:
            early[name] = round(ahead, 2)
    assert not early, f"task runs shown running this many seconds before their chunk started: {early}"


@pytest.mark.concurrent
def test_a_worker_reads_the_secret_block_its_settings_name_from_the_flows_server(
    run_cli, cli_env, tmp_path: Path
) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    key, block = f"sk-{secrets.token_hex(8)}", f"rf-key-{secrets.token_hex(4)}"
    with temporary_settings({PREFECT_API_URL: cli_env["PREFECT_API_URL"]}):
        asyncio.run(Secret(value=key).asave(block, overwrite=True))
    inp, out = write_rows(tmp_path / "rows.jsonl", 60), tmp_path / "out"
    with worker_host(cli_env, ROLLFLOW_BACKEND__API_KEY_BLOCK=block) as cluster, KeyServer(key) as server:
        res = run_cli(*run_args(inp, out, server.url, cluster))
        seen = server.keys_seen()
    assert res.returncode == 0, res.stderr[-3000:]
    assert seen == {f"Bearer {key}"}, f"requests without the block's key: {seen - {f'Bearer {key}'}}"
    assert key not in res.stderr and key not in res.stdout
