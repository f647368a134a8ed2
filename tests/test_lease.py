"""One writer per output: a second run is refused with who holds the lease; a dead owner's lease is taken."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import orjson
import pytest
from cli_runs import ROWS, run_args, spawn, wait_until
from rollout_data import write_rows

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


def test_second_run_on_same_output_is_refused(run_cli, cli_env, slow_sim, rows_input, reference, tmp_path):
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    # The first run is paused while the second starts: however slow the second's start-up, the first
    # still holds the lease (alive on this host, well inside a TTL longer than any start-up here). So
    # the first run need not be slow: the session's simulator (800 rollouts/s) does.
    env = {**cli_env, "ROLLFLOW_PIPELINE__LEASE_TTL_S": "300"}
    first = spawn(args, env)
    wait_until(lambda: (out / "chunks").exists(), first)
    first.send_signal(signal.SIGSTOP)
    try:
        second = run_cli(*args)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert "in use by another rollflow run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert first.wait(120) == 0
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


@pytest.mark.alone  # a 1.5 s TTL: loss declared before expiry
async def test_keep_declares_the_lease_lost_before_it_can_expire(tmp_path: Path) -> None:
    root = tmp_path / "out"
    lease = Lease(Store(str(root)), 1.5)
    lease.acquire()
    expires_at = orjson.loads((root / "lease.json").read_bytes())["expires_at"]
    shutil.rmtree(root)
    root.write_text("storage that fails every read and write")  # every renewal now errors
    declared: list[float] = []
    await asyncio.wait_for(lease.keep(on_lost=lambda: declared.append(time.time())), timeout=5)
    assert lease.lost and "could not renew its lease" in lease.lost_reason
    assert declared and declared[0] < expires_at, "loss must be declared before the stored lease expires"


@pytest.mark.alone  # a 2 s TTL renewed throughout the run
def test_slow_sync_verifier_does_not_starve_lease_renewals(run_cli, cli_env, tmp_path) -> None:
    """A verifier that blocks longer than the lease lifetime: the lease stays renewed throughout."""
    import blocking_verifier

    ttl_s = 2.0
    assert ttl_s < blocking_verifier.BLOCK_S
    sim = spawn_simulator("--latency-ms", "5", "--slots", "16")
    inp, out = write_rows(tmp_path / "rows.jsonl", 6), tmp_path / "out"
    env = {
        **cli_env,
        "ROLLFLOW_PIPELINE__LEASE_TTL_S": str(ttl_s),
        "PYTHONPATH": str(Path(__file__).parent),
    }
    args = ["run", "--input", str(inp), "--output", str(out), "--backend-kind", "responses",
            "--backend-url", sim.url, "--verifier", "blocking_verifier:verify", "--parallelism", "6",
            "--chunk-size", "3", "--no-progress"]  # fmt: skip
    worst = -float("inf")
    try:
        proc = spawn(args, env)
        t_end = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < t_end:
            try:
                info = orjson.loads((out / "lease.json").read_bytes())
            except (FileNotFoundError, orjson.JSONDecodeError):
                info = None
            if info is not None and proc.poll() is None:
                worst = max(worst, time.time() - info["expires_at"])
            time.sleep(0.02)
        code = proc.wait(10)
    finally:
        sim.stop()
    assert code == 0, proc.stderr.read().decode()[-2000:]
    assert worst > -float("inf"), "the lease was never seen"
    assert worst < 0, f"the stored lease was expired for {worst:.2f}s while the run was still writing"


@pytest.mark.alone  # a 0.6 s TTL: the first commit must land in time
def test_a_commit_after_the_lease_could_expire_is_refused(tmp_path: Path) -> None:
    """The ledger's fence: once the lease is past its safe lifetime, no manifest is written."""
    from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

    store = Store(str(tmp_path))
    lease = Lease(store, ttl_s=0.6)
    lease.acquire()
    ledger = Ledger(store)
    ledger.fence = lease.check
    manifest = ChunkManifest(
        chunk=0, first_task=0, num_tasks=1, rows_expected=1, rows=1, failed=0, sha256="", bytes=0,
        started_at="", committed_at="", wall_s=0.0, attempt=1,
    )  # fmt: skip
    ledger.commit(0, b"{}\n", None, manifest)
    assert ledger.manifest(0) is not None
    time.sleep(0.6)
    with pytest.raises(LeaseLost, match="could not renew"):
        ledger.commit(1, b"{}\n", None, manifest.model_copy(update={"chunk": 1}))
    assert ledger.manifest(1) is None
