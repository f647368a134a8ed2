"""The worker process's collector: a run's slot keeps the run's per-endpoint limits, applies the share
book's answers, and reports what its chunks still have to do."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from rollflow.settings import RunSpec
from rollflow.tasks.collect.progress import ProgressEvent
from rollflow.tasks.scaleout import collector as collector_module
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


class StuckLink:
    """A share book behind a scheduler that does not answer: every exchange blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.waiting = self.most_waiting = 0

    def exchange(self, worker: str, report: dict[str, Any]) -> dict[str, Any] | None:
        with self.lock:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        self.release.wait(30)
        with self.lock:
            self.waiting -= 1
        return {"closed": True}


def test_a_stuck_exchange_never_holds_the_threads_commits_run_on(tmp_path: Path, monkeypatch) -> None:
    """Exchanges that time out over and over (quickly here) stay on their own few threads: the collector
    loop's default executor, where commits and flushes run, still serves at once."""
    monkeypatch.setattr(collector_module, "EXCHANGE_TIMEOUT_S", 0.05)
    spec = RunSpec(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": A})
    collector, link = WorkerCollector.get(), StuckLink()
    run = RemoteRun(spec, WorkerScope(), None, link, 4)
    try:
        asyncio.run_coroutine_threadsafe(collector._slot(run), collector.loop).result(timeout=30)
        time.sleep(1.5)  # ~15 exchanges timed out
        commit_like = asyncio.run_coroutine_threadsafe(asyncio.to_thread(time.time), collector.loop)
        assert commit_like.result(timeout=2)
        assert link.most_waiting <= collector_module.EXCHANGE_THREADS
    finally:
        link.release.set()
