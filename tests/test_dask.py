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


def _verifier_processes(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        try:
            if b"verify_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def test_each_dask_worker_process_verifies_with_one_pool_of_its_own(
    run_cli, cli_env, slow_sim, rows_input, tmp_path
):
    """`--verifier math` on Dask: each worker process starts its own verifier processes once, for all the
    chunks it runs (not one pool per chunk), and the run publishes with every reward computed."""
    out = tmp_path / "out"
    args = [a if a != "agent" else "responses" for a in run_args(rows_input, str(out), slow_sim)]
    args += ["--runner", "dask", "--dask-workers", "2", "--chunk-size", "100", "--limit", "600",
             "--verifier", "math", "--verify-processes", "1"]  # fmt: skip
    proc = spawn(args, cli_env)
    seen: dict[int, set[int]] = {}

    def pools_up() -> bool:
        for worker in dask_workers(proc.pid):
            seen.setdefault(worker, set()).update(_verifier_processes(worker))
        return len(seen) >= 2 and all(seen.values()) and len(list(out.glob("chunks/*.json"))) >= 3

    wait_until(pools_up, proc, timeout_s=180)
    assert proc.wait(300) == 0, proc.stderr.read().decode()[-3000:]
    assert all(len(pids) == 1 for pids in seen.values()), f"verifier processes per Dask worker: {seen}"
    rows = [line for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert len(rows) == 2 * 600 and all(b'"reward":' in row for row in rows)
