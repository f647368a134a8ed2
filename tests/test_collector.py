"""The worker process's collector: a run's slot keeps the run's per-endpoint limits, applies the share
book's answers, and reports what its chunks still have to do."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from share_board import ShareBoard

from rollflow.settings import RunSpec
from rollflow.tasks.collect.progress import ProgressEvent
from rollflow.tasks.scaleout import collector as collector_module
from rollflow.tasks.scaleout.board import Board
from rollflow.tasks.scaleout.collector import RemoteRun, RunSlot, WorkerCollector
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
    slot.apply(me, {"grants": {me: [3, 8]}, "rotation": {B: ["out", 1]}})
    assert slot.ctx.pool.limits() == {A: 8, B: 0} and slot.applied_seq == 3
    assert slot.ctx.limit.limit == 8  # B is out of rotation for every worker: the whole share goes to A
    slot.apply(me, {"grants": {me: [2, 16]}})  # an older answer changes nothing
    assert slot.ctx.pool.limits() == {A: 8, B: 0}
    slot.apply(me, {"rotation": {B: ["in", 2]}})
    assert slot.ctx.pool.limits() == {A: 6, B: 2} and slot.ctx.limit.limit == 8

    slot.start(7, 100)
    slot.count(ProgressEvent("attempt", chunk=7, done=10, run=slot.ctx.run))
    slot.count(ProgressEvent("rollouts", chunk=7, done=5, failed=1, run=slot.ctx.run))
    slot.count(ProgressEvent("rollouts", chunk=8, done=50, run=slot.ctx.run))  # not running here
    slot.count(ProgressEvent("rollouts", chunk=7, done=40, run="other|run"))  # another run's chunk 7
    report = slot.report(me)
    assert slot._left() == 84 and report["chunks"] == {"7": [15, 1, 1]}  # RunSlot._running
    assert report["demand"] == 16, "reported up to the run's limit, beyond which the book allocates the same"
    assert report["applied_seq"] == 3 and report["applied"] == 8
    assert report["rotation"] == {}  # followed, not found here
    assert report["snapshot"]["rollouts"] == 5  # the 10 adopted were counted where they were collected
    # Its next attempt adopts 40 rows of an earlier, partly failed commit (1 failed): the flow's progress goes
    # back there if the chunk is abandoned, so reports carry it once the attempt has read it.
    slot.count(ProgressEvent("attempt", chunk=7, done=40, floor=(40, 1), run=slot.ctx.run))
    assert slot.report(me)["chunks"] == {"7": [40, 0, 1, 40, 1]}


def test_a_slot_recreated_after_idling_goes_on_from_its_first_life(tmp_path: Path, monkeypatch) -> None:
    """A run with no chunk here for IDLE_S loses its slot; its next chunk here opens a new one, whose
    figures (and report numbers, which the board orders by) go on from the first life's."""
    monkeypatch.setattr(collector_module, "IDLE_S", 0.3)
    spec = RunSpec(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": A})
    collector, link = WorkerCollector.get(), RecordingLink()
    run = RemoteRun(spec, WorkerScope(), None, link, 4)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, collector.loop).result(timeout=30)

    first = on_loop(collector._slot(run))
    first.start(3, 20)
    first.count(ProgressEvent("rollouts", chunk=3, done=20, run=first.ctx.run))
    first.end(3)
    first.chunks_done += 1
    key = collector_module.run_key(run)
    deadline = time.monotonic() + 10
    while key in collector.slots and time.monotonic() < deadline:  # the run idles out here
        time.sleep(0.05)
    assert key not in collector.slots
    seq = max(r["n"] for r in link.reports)
    second = on_loop(collector._slot(run))
    assert second is not first
    snap = second.report(collector.worker)["snapshot"]
    assert (snap["rollouts"], snap["chunks"]) == (20, 1) and snap["seq"] > seq


class StuckLink:
    """A share book behind a scheduler that does not answer: every exchange blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.waiting = self.most_waiting = 0

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
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


def test_a_late_out_never_overrides_a_newer_in(tmp_path: Path) -> None:
    """x takes B out, then finds it back; y applies the old "out" only after that. The book orders what
    it heard, and y's following is no finding of its own: B stays in for both (it used to stay out for
    FOLLOWED_TRIAL_S everywhere, x included)."""
    collector = WorkerCollector.get()
    spec = RunSpec(
        input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": f"{A},{B}"}
    )
    channel = ShareBoard()
    run = RemoteRun(spec, WorkerScope(), None, channel, {A: 8, B: 8})
    x, y = (asyncio.run_coroutine_threadsafe(collector._open(run), collector.loop).result(30) for _ in "xy")
    board = Board(channel, {A: 8, B: 8}, asyncio.new_event_loop())

    def exchange(name: str, slot: RunSlot) -> None:
        reply = channel.exchange(name, slot.report(name))
        if reply:
            slot.apply(name, reply)

    for name, slot in (("x", x), ("y", y)):
        exchange(name, slot)
    board.round()
    xb = x.ctx.pool.endpoint(B)
    x.ctx.pool.failed(xb, "connection", refused=True)  # x finds B down
    exchange("x", x)
    board.round()  # publishes "out"
    stale = channel.exchange("y", y.report("y"))  # y reads it ...
    x.ctx.pool.succeeded(xb, 0.01)  # ... x's trial finds B back
    time.sleep(0.01)
    y.apply("y", stale)  # ... y applies the "out" only now
    for _ in range(3):
        exchange("x", x)
        exchange("y", y)
        board.round()
    exchange("x", x)
    exchange("y", y)
    assert xb.in_rotation and y.ctx.pool.endpoint(B).in_rotation


class RecordingLink:
    """A share book that answers at once and keeps every report it got."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        if report is not None:
            self.reports.append(report)
        return {"grants": {}}


async def _apply(slot: RunSlot, worker: str, share: int) -> None:
    slot.apply(worker, {"grants": {worker: [1, share]}})


@pytest.mark.alone  # a report within 5 s of a 0.8 s pause
def test_a_paused_worker_drops_its_share_before_it_reports_again(tmp_path: Path, monkeypatch) -> None:
    """A process paused past SHARE_LEASE_S (the book may have given its share away meanwhile) resumes with
    no share: its first report says so, rather than refreshing the old share with an exchange that was
    under way, or one that succeeds first."""
    monkeypatch.setattr(collector_module, "SHARE_LEASE_S", 0.5)
    spec = RunSpec(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": A})
    collector, link = WorkerCollector.get(), RecordingLink()
    run = RemoteRun(spec, WorkerScope(), None, link, 8)
    slot = asyncio.run_coroutine_threadsafe(collector._slot(run), collector.loop).result(timeout=30)

    paused_at: list[int] = []

    def pause() -> None:  # the collector's loop does not run for longer than SHARE_LEASE_S
        paused_at.append(slot.reports)  # reports built before the pause have no larger number
        time.sleep(0.8)

    asyncio.run_coroutine_threadsafe(_apply(slot, collector.worker, 8), collector.loop).result(timeout=5)
    assert slot.ctx.limit.limit == 8
    collector.loop.call_soon_threadsafe(pause)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = [r for r in list(link.reports) if paused_at and r["n"] > paused_at[0]]
        if after:
            break
        time.sleep(0.01)
    assert after and after[0]["applied"] == 0, after[:1]
    assert slot.ctx.limit.limit == 0


class VanishingBoard:
    """A book that grants 8, then whose board is gone (deleted under the run, or the run ended)."""

    def __init__(self) -> None:
        self.exchanges = 0

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        self.exchanges += 1
        return {"grants": {worker: [1, 8]}} if self.exchanges == 1 else {"gone": True}


def chunk_on_a_vanishing_board(tmp_path: Path) -> tuple[WorkerCollector, VanishingBoard, RemoteRun, RunSlot]:
    """A run's slot on this process's collector, with one chunk running, whose book then vanishes."""
    spec = RunSpec(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": A})
    collector, link = WorkerCollector.get(), VanishingBoard()
    run = RemoteRun(spec, WorkerScope(), None, link, 8)
    slot = asyncio.run_coroutine_threadsafe(collector._slot(run), collector.loop).result(timeout=30)
    collector.loop.call_soon_threadsafe(slot.start, 0, 100)
    return collector, link, run, slot


@pytest.mark.alone  # 5 exchanges within 10 s
def test_a_board_gone_under_a_running_chunk_keeps_its_share_until_the_chunk_ends(tmp_path: Path) -> None:
    collector, link, run, slot = chunk_on_a_vanishing_board(tmp_path)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and link.exchanges < 5:
        time.sleep(0.02)
    assert link.exchanges >= 5 and slot.ctx.limit.limit == 8, "a running chunk lost its share"
    assert collector.slots.get(collector_module.run_key(run)) is slot
    collector.loop.call_soon_threadsafe(slot.end, 0)
    while time.monotonic() < deadline and collector_module.run_key(run) in collector.slots:
        time.sleep(0.02)
    assert collector_module.run_key(run) not in collector.slots, "the ended run's slot stayed open"
    assert slot.ctx.limit.limit == 0


def test_a_board_gone_for_good_drops_a_running_chunks_share_after_the_lease(
    tmp_path: Path, monkeypatch
) -> None:
    """A chunk left running after its run ended (an engine that does not stop a running task) keeps no
    share the book no longer accounts for: only a board confirms it."""
    monkeypatch.setattr(collector_module, "SHARE_LEASE_S", 0.5)
    collector, link, _, slot = chunk_on_a_vanishing_board(tmp_path)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (link.exchanges < 2 or slot.ctx.limit.limit):
        time.sleep(0.02)
    assert link.exchanges >= 2 and slot.ctx.limit.limit == 0, "the orphaned chunk kept its share"
    collector.loop.call_soon_threadsafe(slot.end, 0)
