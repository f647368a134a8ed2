"""rollflow's preloads turn down Dask's own periodic work in the processes that run chunks: the worker's
statistical profiler (100 wake-ups a second that only sample threads waiting on the collector) and the
tick of the worker and its nanny; `ROLLFLOW_DASK_MONITORS=keep` leaves Dask's settings alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
from fixtures_dask import BIN, PRELOAD, PRELOAD_NANNY

from rollflow.infra.local import free_port
from rollflow.tasks.scaleout.monitors import DROPPED, KEEP_ENV, TICK_MS

pytestmark = pytest.mark.concurrent
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file


def _monitors(dask_worker: Any) -> dict[str, Any]:
    callbacks = dask_worker.periodic_callbacks
    return {
        "names": sorted(callbacks),
        "tick_ms": callbacks["tick"].callback_time,
        "running": sorted(name for name, pc in callbacks.items() if pc.is_running()),
    }


def _nanny_tick(dask_worker: Any) -> float:  # run on the nanny: Dask passes it under this name
    return dask_worker.periodic_callbacks["tick"].callback_time


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    from distributed import Client

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **request.param}
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
             "--no-dashboard"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ),
        subprocess.Popen(
            [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
             "--no-dashboard", "--preload", PRELOAD, "--preload-nanny", PRELOAD_NANNY],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ),
    ]  # fmt: skip
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            yield client
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
def test_the_preloads_drop_the_profiler_and_slow_the_ticks(cluster: Any) -> None:
    (worker,) = cluster.run(_monitors).values()
    assert not set(DROPPED) & set(worker["names"]), worker
    assert worker["tick_ms"] == TICK_MS
    assert {"heartbeat", "tick"} <= set(worker["running"]), "the worker's other callbacks still run"
    assert list(cluster.run(_nanny_tick, nanny=True).values()) == [TICK_MS]


@pytest.mark.parametrize("cluster", [{KEEP_ENV: "keep"}], indirect=True)
def test_keep_leaves_dasks_monitors_as_configured(cluster: Any) -> None:
    (worker,) = cluster.run(_monitors).values()
    assert set(DROPPED) <= set(worker["running"]), worker
    assert worker["tick_ms"] == 20
    assert list(cluster.run(_nanny_tick, nanny=True).values()) == [20]
