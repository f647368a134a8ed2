"""Every command that writes to an output holds its lease, and every path that sends requests reads the
API key the same way (Secret blocks included): `diagnose`/`tune` and Dask workers like `run`."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest
from key_server import KeyServer
from rollout_data import write_rows

from rollflow.tasks.storage.lease import Lease
from rollflow.tasks.storage.store import Store


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def stage_args(command: str, inp: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        command, "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", url,
        "--chunk-size", "25", "--diagnose-rows", "10", "--diagnose-low", "1", "--diagnose-high", "2",
        "--no-progress", *extra,
    ]  # fmt: skip


def save_secret(prefect_server, name: str, value: str) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        asyncio.run(Secret(value=value).asave(name, overwrite=True))


def test_tune_and_diagnose_refused_while_another_run_holds_the_output(run_cli, fast_sim, tmp_path) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 100), tmp_path / "out"
    done = run_cli(*stage_args("run", inp, out, fast_sim.url, "--parallelism", "8"))
    assert done.returncode == 0, done.stderr
    before = snapshot(out / "chunks")
    assert before, "the first run must have committed chunks"
    holder = Lease(Store(str(out)), 60)
    holder.acquire()
    try:
        for command, extra in (("tune", ("--restart", "--num-repeats", "2")), ("diagnose", ())):
            res = run_cli(*stage_args(command, inp, out, fast_sim.url, *extra))
            assert res.returncode == 2, (command, res.stderr[-2000:])
            assert "in use by another rollflow run" in res.stderr and f"pid {os.getpid()}" in res.stderr
            assert snapshot(out / "chunks") == before, f"`rollflow {command}` changed committed chunks"
            assert not (out / "parts").exists() or not any((out / "parts").rglob("*.jsonl"))
    finally:
        holder.release()


@pytest.mark.parametrize("command", ["diagnose", "run-dask"])
def test_api_key_from_secret_block(run_cli, prefect_server, command: str, tmp_path) -> None:
    key, block = f"sk-{secrets.token_hex(8)}", f"rf-key-{secrets.token_hex(4)}"
    save_secret(prefect_server, block, key)
    inp, out = write_rows(tmp_path / "rows.jsonl", 60), tmp_path / "out"
    env = {"ROLLFLOW_BACKEND__API_KEY_BLOCK": block}
    with KeyServer(key) as server:
        if command == "diagnose":
            res = run_cli(*stage_args("diagnose", inp, out, server.url), env=env)
        else:
            extra = ("--parallelism", "4", "--runner", "dask", "--dask-workers", "1")
            res = run_cli(*stage_args("run", inp, out, server.url, *extra), env=env)
        seen = server.keys_seen()
    assert seen == {f"Bearer {key}"}, f"requests without the block's key: {seen - {f'Bearer {key}'}}"
    assert res.returncode == 0, res.stderr[-2000:]
    assert key not in res.stderr and key not in res.stdout
