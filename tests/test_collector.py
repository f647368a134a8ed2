"""The worker process's collector: a run's slot keeps the run's per-endpoint limits, applies the share
book's answers, and reports what its chunks still have to do."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rollflow.settings import RunSpec
from rollflow.tasks.collect.progress import ProgressEvent
from rollflow.tasks.scaleout.collector import RemoteRun, WorkerCollector
from rollflow.tasks.scaleout.scope import WorkerScope

A, B = "http://127.0.0.1:9", "http://127.0.0.1:10"


def test_a_slot_shares_the_runs_endpoint_limits_and_follows_the_book(tmp_path: Path) -> None:
    spec = RunSpec(
        input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": f"{A},{B}"}
    )
    collector = WorkerCollector.get()
    run = RemoteRun(spec, WorkerScope(), None, None, {A: 12, B: 4})
    slot = asyncio.run_coroutine_threadsafe(collector._open(run), collector.loop).result(timeout=30)
    assert slot.run_limits == {A: 12, B: 4}
    me = collector.worker
    assert slot.ctx.limit.limit == 16  # no link: the whole limit, as one process
    slot.apply(me, {"grants": {me: [3, 8]}, "rotation": {B: ["out", time.time()]}})
    assert slot.ctx.pool.limits() == {A: 6, B: 2} and slot.applied_seq == 3
    assert slot.ctx.limit.limit == 6  # B is out of rotation for every worker: its part of the share too
    slot.apply(me, {"grants": {me: [2, 16]}})  # an older answer changes nothing
    assert slot.ctx.pool.limits() == {A: 6, B: 2}

    slot.start(7, 100)
    slot.count(ProgressEvent("attempt", chunk=7, done=10))
    slot.count(ProgressEvent("rollouts", chunk=7, done=5, failed=1))
    slot.count(ProgressEvent("rollouts", chunk=8, done=50))  # another run's chunk: not this slot's
    report = slot.report(me)
    assert report["demand"] == 84 and report["chunks"] == {"7": [15, 1]}
    assert report["applied_seq"] == 3 and report["applied"] == 8
    assert report["rotation"][B][0] == "out" and report["snapshot"]["rollouts"] == 15
