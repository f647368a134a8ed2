"""A Dask cluster as on separate machines: a `dask scheduler` and `dask worker` processes, each its own
process tree on 127.0.0.1, with the environment a worker host would have (Prefect API, S3 keys)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollflow.infra.local import Service, free_port

BIN = Path(sys.executable).parent
PRELOAD = "rollflow.tasks.wrappers.preload"
PRELOAD_NANNY = "rollflow.tasks.wrappers.preload_nanny"


@dataclass
class DaskCluster:
    address: str
    env: dict[str, str]
    scheduler: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add_worker(self, nthreads: int = 2, *preloads: str) -> subprocess.Popen[bytes]:
        cmd = [str(BIN / "dask"), "worker", self.address, "--nthreads", str(nthreads), "--nworkers", "1",
               "--host", "127.0.0.1", "--no-dashboard", "--preload", PRELOAD,
               "--preload-nanny", PRELOAD_NANNY]  # fmt: skip
        for preload in preloads:
            cmd += ["--preload", preload]
        proc = subprocess.Popen(
            cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.workers.append(proc)
        return proc

    def wait_for_workers(self, n: int, timeout_s: float = 60) -> None:
        from distributed import Client

        with Client(self.address, timeout=timeout_s) as client:
            client.wait_for_workers(n, timeout=timeout_s)

    def worker_pids(self) -> list[int]:
        """The worker processes themselves (a `dask worker` command runs its worker in a child process)."""
        from distributed import Client

        with Client(self.address, timeout=30) as client:
            return list(client.run(os.getpid).values())

    def stop(self) -> None:
        for proc in [*self.workers, self.scheduler]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in [*self.workers, self.scheduler]:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@contextlib.contextmanager
def own_cluster(
    env: dict[str, str], workers: int = 2, preloads: tuple[str, ...] = ()
) -> Iterator[DaskCluster]:
    """A scheduler and `workers` worker processes (with rollflow's preloads and `preloads`) in `env`."""
    port = free_port()
    env = {**env, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    cmd = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
    scheduler = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    cluster = DaskCluster(f"tcp://127.0.0.1:{port}", env, scheduler)
    try:
        for _ in range(workers):
            cluster.add_worker(2, *preloads)
        cluster.wait_for_workers(workers)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def dask_cluster(cli_env: dict[str, str], moto_s3: Any) -> Iterator[DaskCluster]:
    with own_cluster({**cli_env, **moto_s3.env}) as cluster:
        yield cluster


def sim_stats(sim: Service) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{sim.url}/stats", timeout=10) as reply:
        return json.loads(reply.read())


def reset_stats(sim: Service) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{sim.url}/stats/reset", method="POST"), timeout=10)


def set_latency(sim: Service, latency_ms: float) -> None:
    """Change the simulator's latency for the requests that start from now on."""
    import json
    import urllib.request

    body = json.dumps({"latency_ms": latency_ms}).encode()
    request = urllib.request.Request(f"{sim.url}/admin/config", data=body, method="POST")
    urllib.request.urlopen(request, timeout=10)
