"""One writer per output: a second run is refused with who holds the lease; a dead owner's lease is taken."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest
from cli_runs import ROWS, run_args, spawn, wait_until

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.storage.lease import Lease, LeaseHeld, LeaseLost
from rollflow.tasks.storage.store import Store


def foreign_lease(expires_in: float) -> bytes:
    now = time.time()
    return orjson.dumps(
        {
            "owner": "gpu-node-7:4242:ab",
            "host": "gpu-node-7",
            "pid": 4242,
            "acquired_at": now - 100,
            "expires_at": now + expires_in,
        }
    )


@pytest.mark.parametrize("where", ["local", "s3"])
def test_only_one_lease_wins(where: str, tmp_path: Path, moto_s3) -> None:
    root = str(tmp_path / "out") if where == "local" else f"s3://{moto_s3.new_bucket()}/run"
    a, b = Lease(Store(root), 30), Lease(Store(root), 30)
    a.acquire()
    with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()} on .* lease runs until"):
        b.acquire()
    a.renew()
    a.release()
    b.acquire()
    with pytest.raises(LeaseLost):
        a.renew()
    b.release()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_foreign_lease_refused_until_it_expires(where: str, tmp_path: Path, moto_s3) -> None:
    root = str(tmp_path / "out") if where == "local" else f"s3://{moto_s3.new_bucket()}/run"
    store = Store(root)
    store.write_bytes("lease.json", foreign_lease(+600))
    with pytest.raises(LeaseHeld, match="pid 4242 on gpu-node-7"):
        Lease(store, 30).acquire()
    store.write_bytes("lease.json", foreign_lease(-1))
    taker = Lease(store, 30)
    taker.acquire()
    assert orjson.loads(store.read_bytes("lease.json"))["owner"] == taker.owner


def test_second_run_on_same_output_is_refused(run_cli, cli_env, rows_input, reference, tmp_path):
    sim = spawn_simulator("--latency-ms", "50", "--slots", "8")  # 160/s: the first run lasts ~15 s
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), sim)
    try:
        first = spawn(args, cli_env)
        wait_until(lambda: (out / "chunks").exists(), first)
        second = run_cli(*args)
        assert first.poll() is None, "the first run must still be running for this test to mean anything"
        assert second.returncode == 2
        assert "in use by another rollflow run" in second.stderr and f"pid {first.pid}" in second.stderr
        assert first.wait(120) == 0
    finally:
        sim.stop()
    assert (out / "rollouts.jsonl").read_bytes() == reference
    assert not (out / "lease.json").exists(), "a finished run releases its lease"


def test_killed_owner_on_this_host_is_taken_over(run_cli, cli_env, slow_sim, rows_input, reference, tmp_path):
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    first = spawn(args, cli_env)
    wait_until(lambda: (out / "chunks").exists(), first)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert (out / "lease.json").exists()
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == ROWS * 2
