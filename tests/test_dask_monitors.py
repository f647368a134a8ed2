"""rollflow's preloads turn down Dask's own periodic work in the processes that run chunks: the worker's
statistical profiler (100 wake-ups a second that only sample threads waiting on the collector), and a
default tick and memory monitor of the worker and its nanny; `ROLLFLOW_DASK_MONITORS=keep` leaves Dask's
settings alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fixtures_dask import BIN, PRELOAD, PRELOAD_NANNY

from rollflow.infra.local import free_port
from rollflow.tasks.scaleout.monitors import DASK_TICK_MS, DROPPED, KEEP_ENV, SLOWED, TICK_MS

pytestmark = pytest.mark.concurrent
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file


def _monitors(dask_worker: Any) -> dict[str, Any]:  # Dask passes the worker, nanny or scheduler by this name
    callbacks = dask_worker.periodic_callbacks
    return {
        "names": sorted(callbacks),
        "tick_ms": callbacks["tick"].callback_time,
        "memory_ms": callbacks["memory_monitor"].callback_time,
        "running": sorted(name for name, pc in callbacks.items() if pc.is_running()),
    }


def _scheduler_tick(dask_scheduler: Any) -> float:
    return dask_scheduler.periodic_callbacks["tick"].callback_time


@dataclass
class Cluster:
    client: Any
    worker_log: Path

    def worker(self) -> dict[str, Any]:
        (found,) = self.client.run(_monitors).values()
        return found

    def nanny(self) -> dict[str, Any]:
        (found,) = self.client.run(_monitors, nanny=True).values()
        return found

    def nanny_tick(self) -> float:
        return self.nanny()["tick_ms"]


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    from distributed import Client

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **request.param.get("env", {})}
    port = str(free_port())
    address = f"tcp://127.0.0.1:{port}"
    scheduler = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", port, "--no-dashboard"]
    if request.param.get("scheduler_preload"):
        scheduler += ["--preload", PRELOAD]
    worker = [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
              "--no-dashboard", "--preload", PRELOAD, "--preload-nanny", PRELOAD_NANNY]  # fmt: skip
    log = tmp_path / "worker.log"
    procs = []
    with log.open("wb") as sink:
        for cmd, out in ((scheduler, subprocess.DEVNULL), (worker, sink)):
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True))
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            yield Cluster(client, log)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_the_preloads_drop_the_profiler_and_slow_the_ticks(cluster: Cluster) -> None:
    worker = cluster.worker()
    assert not set(DROPPED) & set(worker["names"]), worker
    assert worker["tick_ms"] == TICK_MS
    assert {"heartbeat", "tick"} <= set(worker["running"]), "the worker's other callbacks still run"
    assert cluster.nanny_tick() == TICK_MS
    memory_ms = SLOWED["memory_monitor"][1]
    assert worker["memory_ms"] == memory_ms and cluster.nanny()["memory_ms"] == memory_ms
    assert "memory_monitor" in worker["running"]


@pytest.mark.parametrize("cluster", [{"env": {KEEP_ENV: "keep"}}], indirect=True)
def test_keep_leaves_dasks_monitors_as_configured(cluster: Cluster) -> None:
    worker = cluster.worker()
    assert set(DROPPED) <= set(worker["running"]), worker
    assert worker["tick_ms"] == DASK_TICK_MS and cluster.nanny_tick() == DASK_TICK_MS
    dask_memory_ms = SLOWED["memory_monitor"][0]
    assert worker["memory_ms"] == dask_memory_ms and cluster.nanny()["memory_ms"] == dask_memory_ms


USERS_OWN = {
    "env": {
        KEEP_ENV: "Off",
        "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "100ms",
        "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "200ms",
    },
    "scheduler_preload": True,
}


@pytest.mark.parametrize("cluster", [USERS_OWN], indirect=True)
def test_a_tick_set_by_hand_a_scheduler_and_an_unknown_value(cluster: Cluster) -> None:
    """A tick and a memory monitor the user configured are kept; a scheduler given the preload is left
    alone; a value other than keep or quiet is named, as given, in a warning, and the monitors are turned
    down."""
    worker = cluster.worker()
    assert not set(DROPPED) & set(worker["names"]), worker
    assert worker["tick_ms"] == 100 and cluster.nanny_tick() == 100
    assert worker["memory_ms"] == 200 and cluster.nanny()["memory_ms"] == 200
    assert cluster.client.run_on_scheduler(_scheduler_tick) == 100
    assert f"{KEEP_ENV}='Off' is not 'keep' or 'quiet'" in cluster.worker_log.read_text()
