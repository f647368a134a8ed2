"""A run stopped while its input is scanned stops the scan: the plan runs on a thread, which a cancelled
run cannot cancel, so without a stop the command waited for the whole scan and the plan wrote run.json
after the run had let go of its output."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rollout_data import write_rows

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.plan import plan_stoppable
from rollflow.tasks.collect.runtime import open_run

ROWS = 300_000


def handles_for(inp: Path, out: Path):
    spec = RunSpec(
        input=str(inp), output=str(out), backend={"kind": "agent", "url": "http://127.0.0.1:9", "model": "m"}
    )
    return open_run(spec, RollflowSettings())


def plan(inp: Path, out: Path):
    h = handles_for(inp, out)
    return plan_stoppable(h.spec, h.store, h.ledger, h.input_options, None)


def test_a_cancelled_plan_stops_its_scan_and_writes_nothing(tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "in.jsonl", ROWS)
    t0 = time.perf_counter()
    whole = asyncio.run(plan(inp, tmp_path / "whole"))
    full_s = time.perf_counter() - t0
    assert whole.identity.rows == ROWS

    async def cancelled() -> None:
        task = asyncio.ensure_future(plan(inp, tmp_path / "out"))
        await asyncio.sleep(full_s / 10)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("the plan finished although it was cancelled")

    t = time.perf_counter()
    asyncio.run(cancelled())  # returns once the loop's threads have ended, as a command's exit waits
    stop_s = time.perf_counter() - t - full_s / 10
    assert not (tmp_path / "out" / "run.json").exists(), "the plan went on after its run was cancelled"
    assert stop_s < full_s / 2, f"stopping took {stop_s:.2f} s of a {full_s:.2f} s scan"
