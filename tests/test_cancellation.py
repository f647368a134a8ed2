"""No writer outlives its run: a lost lease or a deadline stops every chunk before the flow returns, on
this process's event loop and on Dask; a combination Dask cannot honour is refused up front."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from cli_runs import run_args, spawn

from rollflow.infra.local import spawn_simulator
from rollflow.settings import RunSpec
from rollflow.tasks.storage.lease import LeaseLost

WATCH_S = 3.0


def written_after(out: Path, t: float) -> list[str]:
    """Files of the run (not the lease) last modified after wall time t."""
    return [
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file() and "lease" not in p.name and p.stat().st_mtime > t
    ]


def take_over(out: Path) -> None:
    """What a second run does once it presumes this one dead: the lease names another owner."""
    now = time.time()
    body = {"owner": "other:1:ab", "host": "other", "pid": 1, "acquired_at": now, "expires_at": now + 600}
    (out / "lease.json").write_bytes(orjson.dumps(body))


@pytest.mark.alone  # a 1.5 s lease TTL and a run stopped mid-way
async def test_lost_lease_stops_every_chunk_before_the_flow_returns(
    prefect_server, rows_input, tmp_path, monkeypatch
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rollflow.flows.pipeline import rollflow_collect

    monkeypatch.setenv("ROLLFLOW_PIPELINE__LEASE_TTL_S", "1.5")
    sim = spawn_simulator("--latency-ms", "50", "--slots", "8")  # 160/s: 1,200 rollouts take ~8 s
    out = tmp_path / "out"
    spec = RunSpec(
        input=str(rows_input),
        output=str(out),
        backend={"kind": "agent", "url": sim.url},
        collection={"parallelism": 8, "chunk_size": 40, "chunks_in_flight": 4},
    )

    async def take_over_after_first_commit() -> None:
        for _ in range(3000):
            if list(out.glob("chunks/*.json")):
                take_over(out)
                return
            await asyncio.sleep(0.01)

    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
            thief = asyncio.create_task(take_over_after_first_commit())
            with pytest.raises(LeaseLost, match=r"(took|taken) over"):
                await rollflow_collect(**spec.parameters())
            ended = time.time()
            await thief
            await asyncio.sleep(WATCH_S)  # the loop runs on: an orphaned chunk job would commit now
    finally:
        sim.stop()
    total = -(-len(rows_input.read_bytes().splitlines()) // 40)
    assert len(list(out.glob("chunks/*.json"))) < total, "the run must have been stopped mid-way"
    assert written_after(out, ended) == [], "chunk jobs kept writing after the flow returned"


@pytest.mark.alone  # the run ends within 3x its deadline
def test_dask_run_stops_at_its_deadline(cli_env, rows_input, tmp_path) -> None:
    sim = spawn_simulator("--latency-ms", "50", "--slots", "4")  # 80/s: 2,400 rollouts take ~30 s
    out = tmp_path / "out"
    deadline_s = 10.0
    args = [*run_args(rows_input, str(out), sim), "--runner", "dask", "--dask-workers", "1",
            "--parallelism", "4", "--deadline-s", str(deadline_s)]  # fmt: skip
    try:
        t0 = time.monotonic()
        proc = spawn(args, cli_env)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        took = time.monotonic() - t0
        ended = time.time()
        err = proc.stderr.read().decode()
        time.sleep(WATCH_S)
    finally:
        sim.stop()
    assert code == 1, err[-2000:]
    assert f"stopped at its deadline ({deadline_s:g}s)" in err
    assert took < 3 * deadline_s, f"the run took {took:.1f}s with a {deadline_s:g}s deadline"
    assert not (out / "rollouts.jsonl").exists()
    assert written_after(out, ended) == [], "Dask workers kept writing after the run ended"


def test_dask_with_adaptive_parallelism_is_refused(run_cli, fast_sim, rows_input, tmp_path) -> None:
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), fast_sim), "--runner", "dask", "--parallelism", "adaptive"]
    res = run_cli(*args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--parallelism adaptive is not supported with --runner dask" in res.stderr
    assert not (out / "chunks").exists()


async def test_a_chunk_that_fails_while_its_run_stops_is_not_retried(prefect_server) -> None:
    """A served run kept collecting a minute after Ctrl-C: an error raised while a cancelled chunk unwound
    (a flush that failed on the way out) read as the chunk's failure, and Prefect retried the chunk, whose
    new attempt nothing cancelled any more."""
    from prefect import flow, task
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rollflow.tasks.collect.scheduler import run_chunks
    from rollflow.tasks.wrappers.prefect_tasks import CHUNK_TASK

    attempts: list[float] = []

    @task(**{**CHUNK_TASK, "retry_delay_seconds": [0.2, 0.2, 0.2]})
    async def chunk_task(chunk: SimpleNamespace) -> None:
        attempts.append(time.monotonic())
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise OSError("the flush on the way out failed") from None

    @flow
    async def stopped_run() -> None:
        scheduler = asyncio.create_task(run_chunks([SimpleNamespace(index=0)], chunk_task, 1))
        while not attempts:
            await asyncio.sleep(0.05)
        scheduler.cancel()  # what Ctrl-C does to the run
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await scheduler

    with temporary_settings({PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        await stopped_run()
    assert len(attempts) == 1, f"the stopped chunk was tried {len(attempts)} times"
