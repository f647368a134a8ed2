"""A local Dask cluster of 2 worker processes: the same bytes as one process, even if a worker dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cli_runs import ROWS, run_args, spawn, wait_until


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def dask_workers(pid: int) -> list[int]:
    workers = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline or (b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline):
            workers.append(child)
    return workers


def test_dask_cluster_same_bytes_and_survives_a_dead_worker(
    run_cli, cli_env, slow_sim, rows_input, reference, tmp_path
):
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), slow_sim), "--runner", "dask", "--dask-workers", "2",
            "--chunk-size", "150"]  # fmt: skip
    proc = spawn(args, cli_env)
    wait_until(
        lambda: len(dask_workers(proc.pid)) >= 2 and len(list(out.glob("chunks/*.json"))) >= 1,
        proc,
        timeout_s=120,
    )
    victim = dask_workers(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(300) == 0, proc.stderr.read().decode()[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    assert len(list((out / "chunks").glob("*.json"))) == -(-ROWS // 150)
