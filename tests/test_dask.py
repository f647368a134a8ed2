"""Dask: a scheduler and worker processes as on other hosts, and a local cluster of worker processes."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from cli_runs import ROWS, run_args, spawn, wait_until
from fixtures_dask import PRELOAD, PRELOAD_NANNY, reset_stats, set_latency, sim_stats

from rollflow.infra.local import free_port, spawn_simulator
from rollflow.tasks.backends.endpoints import BACKOFF_MAX_S, FOLLOWED_TRIAL_S


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


def _report(fs, url: str) -> dict:
    with fs.open(f"{url}/report.json", "rb") as f:
        return json.loads(f.read())


def test_dask_workers_publish_the_local_bytes_within_the_limit_when_one_is_killed(
    cli_env, dask_cluster, moto_s3, slow_sim, rows_input, reference
):
    """A scheduler and worker processes as on other hosts, S3 output: the same bytes as one process, every
    rollout once after a worker is SIGKILLed mid-run, and never more than --parallelism at the backend."""
    url = f"s3://{moto_s3.new_bucket()}/out"
    reset_stats(slow_sim)
    victim = dask_cluster.add_worker()
    dask_cluster.wait_for_workers(3)
    args = [*run_args(rows_input, url, slow_sim), "--runner", "dask", "--dask-address", dask_cluster.address]
    proc = spawn(args, {**cli_env, **moto_s3.env})
    fs = moto_s3.fs()
    wait_until(lambda: len(fs.glob(f"{url}/chunks/*.json", refresh=True)) >= 3, proc, timeout_s=120)
    os.killpg(victim.pid, signal.SIGKILL)
    assert proc.wait(300) == 0, proc.stderr.read().decode()[-3000:]
    fs.invalidate_cache()
    assert fs.cat_file(f"{url}/rollouts.jsonl") == reference
    assert len(fs.glob(f"{url}/chunks/*.json", refresh=True)) == -(-ROWS // 40)
    assert sim_stats(slow_sim)["max_in_flight_seen"] <= 16
    report = _report(fs, url)
    assert report["metrics"]["peak_in_flight"] <= 16 and report["peak_in_flight_allowed"] <= 16
    assert len([w for w in report["workers"] if w["rollouts"]]) >= 2


@pytest.mark.alone  # the joining worker must get chunks before the run ends
def test_a_limit_below_the_worker_threads_holds_when_a_worker_joins_mid_run(
    cli_env, dask_cluster, moto_s3, slow_sim, rows_input, tmp_path
):
    """--parallelism 3 over 2 workers x 2 threads, then a third worker joins: it gets chunks and a share,
    and the backend never sees a fourth request."""
    out = tmp_path / "out"
    reset_stats(slow_sim)
    args = [*run_args(rows_input, str(out), slow_sim), "--runner", "dask", "--dask-address",
            dask_cluster.address, "--parallelism", "3", "--limit", "720"]  # fmt: skip
    proc = spawn(args, {**cli_env, **moto_s3.env})
    wait_until(lambda: len(list(out.glob("chunks/*.json"))) >= 1, proc, timeout_s=120)
    set_latency(slow_sim, 1000)  # the run keeps work left however long the new worker takes to start
    try:
        joined = dask_cluster.add_worker()
        dask_cluster.wait_for_workers(3, timeout_s=120)
    finally:
        set_latency(slow_sim, 20)
    try:
        assert proc.wait(300) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        joined.send_signal(signal.SIGTERM)
    assert sim_stats(slow_sim)["max_in_flight_seen"] <= 3
    report = json.loads((out / "report.json").read_text())
    busy = [w for w in report["workers"] if w["rollouts"]]
    assert len(busy) == 3, report["workers"]
    assert sum(w["rollouts"] for w in report["workers"]) == 2 * 720
    assert report["metrics"]["peak_in_flight"] <= 3


@pytest.mark.alone  # counts requests in a time window
def test_a_hung_replica_is_found_once_for_every_worker(cli_env, dask_cluster, moto_s3, rows_input, tmp_path):
    """One replica starts hanging mid-run: after the first worker takes it out, no worker's new chunk
    sends it work again; it gets only the trials that check whether it is back."""
    good, hung = (
        spawn_simulator("--latency-ms", "20", "--slots", "8"),
        spawn_simulator("--latency-ms", "20", "--hang-s", "30"),
    )
    out = tmp_path / "out"
    try:
        args = [*run_args(rows_input, str(out), good), "--backend-url", f"{good.url},{hung.url}",
                "--runner", "dask", "--dask-address", dask_cluster.address, "--timeout-s", "1",
                "--parallelism", "16", "--chunk-size", "20", "--limit", "600"]  # fmt: skip
        proc = spawn(args, {**cli_env, **moto_s3.env})
        wait_until(lambda: len(list(out.glob("chunks/*.json"))) >= 2, proc, timeout_s=120)
        hang = json.dumps({"fault_rate": 1.0, "fault_kinds": ["hang"]}).encode()
        request = urllib.request.Request(f"{hung.url}/admin/config", data=hang, method="POST")
        urllib.request.urlopen(request, timeout=10)
        time.sleep(2 * 1.0 + 1.0)  # a request timeout to find it, one more for requests already sent
        seen, t_seen = sim_stats(hung)["requests"], time.monotonic()
        assert proc.wait(300) == 0, proc.stderr.read().decode()[-3000:]
        rest_s = time.monotonic() - t_seen
        later = sim_stats(hung)["requests"] - seen
    finally:
        good.stop()
        hung.stop()
    chunks_after = len(list(out.glob("chunks/*.json")))
    # Trials only: the worker that took it out tries it every BACKOFF_MAX_S, the others every
    # FOLLOWED_TRIAL_S (one request each). Finding it anew per chunk would cost STREAK_OUT per chunk.
    trials = 3 * (1 + rest_s / BACKOFF_MAX_S + rest_s / FOLLOWED_TRIAL_S)
    assert later <= trials, f"{later} requests to the hung replica in {rest_s:.1f} s ({chunks_after} chunks)"
    report = json.loads((out / "report.json").read_text())
    rows = {row["url"]: row for row in report["endpoints"]}
    assert rows[hung.url]["out_of_rotation_s"] > 0 and report["audit_ok"]


def _verifier_processes(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        try:
            if b"rollflow.tasks.verify.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


@pytest.mark.alone  # sees whole pools within a 2 s settle
@pytest.mark.parametrize(
    ("sizing", "each"), [(("--verify-processes", "1"), 1), (("--verify-node-processes", "4"), 2)]
)
def test_each_dask_worker_process_verifies_with_one_pool_of_its_own(
    run_cli, cli_env, slow_sim, rows_input, tmp_path, sizing, each
):
    """`--verifier math` on Dask: each worker process starts its own verifier processes once, for all the
    chunks it runs (not one pool per chunk), and the run publishes with every reward computed. The node's
    verifier processes are split over its worker processes, never each sized to the whole node."""
    out = tmp_path / "out"
    args = [a if a != "agent" else "responses" for a in run_args(rows_input, str(out), slow_sim)]
    args += ["--runner", "dask", "--dask-workers", "2", "--chunk-size", "100", "--limit", "600",
             "--verifier", "math", *sizing]  # fmt: skip
    seen: dict[int, set[int]] = {}

    def pools_up() -> bool:
        for worker in dask_workers(proc.pid):
            seen.setdefault(worker, set()).update(_verifier_processes(worker))
        return len(seen) >= 2 and all(seen.values()) and len(list(out.glob("chunks/*.json"))) >= 3

    set_latency(slow_sim, 200)  # the run lasts until both workers' pools are seen, however loaded the machine
    try:
        proc = spawn(args, cli_env)
        wait_until(pools_up, proc, timeout_s=180)
        # A pool starts its processes together, but a process is seen only once it has exec'd: look on
        # for a while, so a pool seen half started is seen whole, and one too big shows all of it.
        settle = time.monotonic() + 2.0
        while time.monotonic() < settle and proc.poll() is None:
            pools_up()
            time.sleep(0.05)
    finally:
        set_latency(slow_sim, 20)
    code, err = proc.wait(300), proc.stderr.read().decode()
    assert code == 0, err[-3000:]
    # The run's log says if a worker could not count its node's worker processes (node.py), or replaced a
    # verifier process (pool.py): what sized a pool wrong, or added a process to it.
    assert all(len(pids) == each for pids in seen.values()), (
        f"verifier processes per Dask worker: {seen}\n{err[-3000:]}"
    )
    rows = [line for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert len(rows) == 2 * 600 and all(b'"reward":' in row for row in rows)


def test_a_cluster_class_starts_its_own_workers_scaled_by_adapt(
    run_cli, slow_sim, rows_input, reference, tmp_path
):
    """dask-jobqueue's own machinery (its LocalCluster starts the "jobs" as local processes), scaled by
    adapt between 1 and 2 workers: the run publishes the local runner's bytes."""
    out = tmp_path / "out"
    kwargs = {"cores": 2, "processes": 1, "memory": "2GB", "interface": "lo",
              "worker_extra_args": ["--preload", PRELOAD, "--preload-nanny", PRELOAD_NANNY]}  # fmt: skip
    args = [*run_args(rows_input, str(out), slow_sim), "--runner", "dask",
            "--dask-cluster-class", "dask_jobqueue.local.LocalCluster",
            "--dask-cluster-kwargs", json.dumps(kwargs),
            "--dask-adapt-min", "1", "--dask-adapt-max", "2"]  # fmt: skip
    res = run_cli(*args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    workers = json.loads((out / "report.json").read_text())["workers"]
    assert 1 <= len(workers) <= 2 and sum(w["rollouts"] for w in workers) == 2 * ROWS


def test_a_cluster_class_that_does_not_load_is_a_usage_error(run_cli, slow_sim, rows_input, tmp_path):
    args = [*run_args(rows_input, str(tmp_path / "out"), slow_sim), "--runner", "dask",
            "--dask-cluster-class", "dask_jobqueue.NoSuchCluster"]  # fmt: skip
    res = run_cli(*args)
    assert res.returncode == 2
    assert "--dask-cluster-class 'dask_jobqueue.NoSuchCluster' cannot be loaded" in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_local_cluster_run_shows_no_dask_info_logs(run_cli, fast_sim, rows_input, tmp_path):
    """Dask's INFO lines (scheduler and nanny start, ~40 of them) would bury the run's own output; a user
    who wants them sets DASK_LOGGING__DISTRIBUTED."""
    out = tmp_path / "out"
    args = [
        *run_args(rows_input, str(out), fast_sim),
        "--runner",
        "dask",
        "--dask-workers",
        "1",
        "--limit",
        "40",
    ]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| INFO    | distributed." not in res.stderr and "distributed.scheduler" not in res.stderr, (
        res.stderr
    )
    loud = run_cli(*[a if a != str(out) else str(tmp_path / "loud") for a in args],
                   env={"DASK_LOGGING__DISTRIBUTED": "info"})  # fmt: skip
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "distributed.scheduler" in loud.stderr, loud.stderr[-3000:]


@pytest.mark.alone  # each refusal within 40 s
def test_a_dask_address_nothing_answers_or_not_dasks_is_a_usage_error(
    run_cli, fast_sim, rows_input, tmp_path
) -> None:
    """A scheduler address was only tried mid-run: a closed port failed after Dask's connect timeout with
    a traceback, a web server's port waited on Dask's handshake, and `alice:pw@` or http:// raised
    Dask's ValueError with the address in it."""
    web = fast_sim.url.removeprefix("http://").rstrip("/")
    closed = f"127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    for address, said in (
        (f"tcp://{closed}", f"--dask-address tcp://{closed}: nothing answers there"),
        (f"tcp://{web}", f"--dask-address tcp://{web}: no Dask scheduler answers there"),
        (f"http://{web}", "not a Dask scheduler's address"),
        (f"tcp://alice:pw-7d2e@{closed}", "carries a user and password"),
    ):
        started = time.monotonic()
        flags = ("--runner", "dask", "--dask-address", address)
        res = run_cli(*run_args(rows_input, str(out), fast_sim), *flags)
        assert res.returncode == 2 and said in res.stderr, (address, res.stderr[-3000:])
        assert "pw-7d2e" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert time.monotonic() - started < 40 and not out.exists(), address
