"""A worker writes its report only when what the book allocates by has changed, or REPORT_S after the last
one (an unchanged report every 0.1 s cost each Dask worker about a fifth of its CPU in bench/scale_out.py),
and reads the book's answer every POLL_S while shares move, every `settled_s` of its link (Dask's) while
they are settled."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from rollflow.settings import RunSpec
from rollflow.tasks.collect.progress import ProgressEvent
from rollflow.tasks.scaleout import collector as collector_module
from rollflow.tasks.scaleout.collector import REPORT_S, RemoteRun, RunSlot, WorkerCollector
from rollflow.tasks.scaleout.scope import WorkerScope

A, B = "http://127.0.0.1:9", "http://127.0.0.1:10"


class CountingLink:
    """A share book that answers at once, counting its exchanges and keeping the reports it got; `fail`
    exchanges raise first (an unreachable scheduler), and once `ended` it answers that the run ended."""

    settled_s = 0.5  # as a Dask link's

    def __init__(self, moving: bool = True) -> None:
        self.moving = moving  # what its answers say of the shares
        self.grants: dict[str, list[int]] = {}  # what its answers grant
        self.times: list[float] = []  # when each exchange came (time.monotonic)
        self.exchanges = 0
        self.reports: list[tuple[int, dict[str, Any]]] = []  # (the exchange it came with, the report)
        self.fail = 0
        self.ended = False

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        self.exchanges += 1
        self.times.append(time.monotonic())
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the scheduler cannot be reached")
        if report is not None:
            self.reports.append((self.exchanges, report))
        return {"closed": True} if self.ended else {"grants": dict(self.grants), "moving": self.moving}


def _run(tmp_path: Path, link: CountingLink | None, limit: int | dict[str, int]) -> RemoteRun:
    urls = ",".join(limit) if isinstance(limit, dict) else A
    spec = RunSpec(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": urls})
    return RemoteRun(spec, WorkerScope(), None, link, limit)


def _open(tmp_path: Path, limit: int | dict[str, int]) -> RunSlot:
    """A run's slot with no share book behind it: its reports are asked for by hand."""
    collector = WorkerCollector.get()
    future = asyncio.run_coroutine_threadsafe(collector._open(_run(tmp_path, None, limit)), collector.loop)
    return future.result(timeout=30)


def _rollouts(slot: RunSlot, chunk: int, done: int) -> None:
    slot.count(ProgressEvent("rollouts", chunk=chunk, done=done, run=slot.ctx.run))


def test_a_report_is_due_when_what_the_book_allocates_by_changes(tmp_path: Path) -> None:
    collector = WorkerCollector.get()
    slot = asyncio.run_coroutine_threadsafe(collector._open(_run(tmp_path, None, 8)), collector.loop).result(
        timeout=30
    )
    me = collector.worker
    slot.start(0, 100)
    assert slot.next_report(me, 0.0) is not None, "the first report is always due"
    assert slot.next_report(me, 0.1) is None
    _rollouts(slot, 0, 50)  # 50 left: still above the run's limit of 8, allocated the same
    assert slot.next_report(me, 0.2) is None
    assert slot.next_report(me, REPORT_S) is not None, "one report every REPORT_S at least"
    assert slot.next_report(me, REPORT_S + 0.1) is None
    _rollouts(slot, 0, 45)  # 5 left, below the limit: the book can give the rest to others
    report = slot.next_report(me, REPORT_S + 0.2)
    assert report is not None and report["demand"] == 5
    _rollouts(slot, 0, 1)
    assert slot.next_report(me, REPORT_S + 0.3) is not None, "every change of a demand below the limit"
    # A chunk's second attempt starts: the flow shows its task run once a report names it.
    slot.start(1, 100, 2)
    report = slot.next_report(me, REPORT_S + 0.4)
    assert report is not None and report["chunks"]["1"] == [0, 0, 2], "its counts, and which attempt runs"
    slot.apply(me, {"grants": {me: [4, 2]}})  # a new share applied: the book waits for it
    report = slot.next_report(me, REPORT_S + 0.5)
    assert report is not None and report["applied_seq"] == 4 and report["applied"] == 2
    assert slot.next_report(me, REPORT_S + 0.6) is None
    slot.apply(me, {"rotation": {A: ["out", 1]}})  # followed only: this worker found nothing itself
    assert slot.next_report(me, REPORT_S + 0.7) is None
    slot.end(0)
    slot.end(1)
    assert slot.next_report(me, REPORT_S + 0.8) is not None


def _exchanges_in(link: CountingLink, tmp_path: Path, seconds: float) -> tuple[int, int]:
    """A run's slot with one chunk running and nothing changing: its exchanges and reports in `seconds`."""
    collector = WorkerCollector.get()
    slot = asyncio.run_coroutine_threadsafe(collector._slot(_run(tmp_path, link, 8)), collector.loop).result(
        timeout=30
    )
    collector.loop.call_soon_threadsafe(slot.start, 0, 100)
    time.sleep(seconds)
    return link.exchanges, len(link.reports)


@pytest.mark.alone  # counts exchanges in 1.5 s
def test_an_unchanged_worker_reads_every_poll_while_shares_move(tmp_path: Path) -> None:
    """The exchanges go on every POLL_S while the book says shares move; the reports only when due."""
    link = CountingLink(moving=True)
    try:
        exchanges, reports = _exchanges_in(link, tmp_path, 1.5)
        assert exchanges >= 8, exchanges
        assert reports <= 3, f"{reports} reports in {exchanges} exchanges with nothing changed"
    finally:
        link.ended = True  # the slot closes instead of polling on for the rest of the session


def _between(link: CountingLink, start: float, end: float) -> int:
    return sum(1 for t in list(link.times) if start <= t < end)


@pytest.mark.alone  # measures the gaps between reads
def test_a_settled_worker_reads_every_settled_s_and_reports_what_changes_at_once(
    tmp_path: Path, monkeypatch
) -> None:
    """With shares settled a worker still reads the book every `settled_s` (the book may cut its share for a
    worker that needs one), and a change the book must hear (a chunk starts) goes at the next POLL_S."""
    monkeypatch.setattr(collector_module, "REPORT_S", 100.0)  # no report falls due by the clock
    link, settled = CountingLink(moving=False), CountingLink.settled_s
    try:
        _exchanges_in(link, tmp_path, 0.6)  # its first reports, and the quick reads after them
        start = time.monotonic()
        time.sleep(6 * settled)
        times = [t for t in list(link.times) if start <= t < start + 6 * settled]
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        # A read at the first look (every POLL_S) once settled_s has passed: gaps of settled_s to
        # settled_s + POLL_S, a late loop making some longer. None if it only read when a report was due,
        # 1 s at one read a second, POLL_S at every look.
        assert len(gaps) >= 3, f"{len(times)} exchanges in {6 * settled:.1f} s, settled"
        median = gaps[len(gaps) // 2]
        poll = collector_module.POLL_S
        assert settled - poll / 2 <= median <= settled + 1.5 * poll, f"reads {median:.2f} s apart: {gaps}"
        collector = WorkerCollector.get()
        slot = next(s for s in collector.slots.values() if s.link is link)
        before = link.exchanges
        collector.loop.call_soon_threadsafe(slot.start, 5, 100)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("5" in r["chunks"] for _, r in link.reports):
            time.sleep(0.02)
        named = [n for n, r in link.reports if "5" in r["chunks"]]
        # the exchange under way when the chunk started may have been built before it: the next one names it
        assert named and named[0] <= before + 2, (before, named[:1])
    finally:
        link.ended = True
        link.moving = True  # read at the next POLL_S: the slot closes


@pytest.mark.alone  # counts exchanges in a time window
def test_a_worker_whose_share_moved_reads_every_poll_for_a_while(tmp_path: Path, monkeypatch) -> None:
    """A share that moved is often followed by another move (a tail goes on, a new chunk takes it back):
    for FOLLOW_S after its share moved a worker reads every POLL_S though the book says settled."""
    monkeypatch.setattr(collector_module, "REPORT_S", 100.0)
    link = CountingLink(moving=False)
    follow, answer = collector_module.FOLLOW_S, collector_module.ANSWER_S
    try:
        _exchanges_in(link, tmp_path, 0.6)
        link.grants = {WorkerCollector.get().worker: [1, 8]}
        granted = time.monotonic()
        time.sleep(follow + CountingLink.settled_s + 0.2)
        applied = min(t for t in list(link.times) if t >= granted)  # the read that brought the new share
        # From the end of the quick reads that follow its report of the applied share (ANSWER_S) to
        # FOLLOW_S after it applied it: every POLL_S reads about 6 there, settled reads at most 2.
        late = _between(link, applied + answer + 0.05, applied + follow - 0.05)
        assert late >= 4, (
            f"{late} exchanges from {answer + 0.05:.2f} s to {follow - 0.05:.2f} s after it moved"
        )
    finally:
        link.ended = True
        link.moving = True


class RoundLink(CountingLink):
    """A book that, as the real board, answers a report with what it published before reading it: the grant
    for a worker's first chunk comes with the worker's next read, a round later."""

    settled_s = 5.0  # longer than the test waits: only the quick reads after a report can bring the grant

    def __init__(self) -> None:
        super().__init__(moving=False)
        self.read_at = 0.0

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        answer = super().exchange(worker, report)
        if report is not None and report["chunks"] and not self.grants:
            self.grants, self.read_at = {worker: [1, 8]}, time.monotonic()
        return answer


@pytest.mark.alone  # a grant read within 3 s
def test_a_worker_reads_its_answer_soon_after_a_report_that_changed_what_it_needs(
    tmp_path: Path, monkeypatch
) -> None:
    """A worker's first chunk is reported, and the book's grant for it is published after the answer that
    report came back with: the worker reads again within ANSWER_S instead of waiting `settled_s`."""
    monkeypatch.setattr(collector_module, "REPORT_S", 100.0)
    link = RoundLink()
    try:
        _exchanges_in(link, tmp_path, 0.05)
        slot = next(s for s in WorkerCollector.get().slots.values() if s.link is link)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and slot.ctx.pool.share != 8:
            time.sleep(0.01)
        waited = time.monotonic() - link.read_at
        assert slot.ctx.pool.share == 8, f"no share {waited:.2f} s after the book read the first report"
    finally:
        link.ended = True
        link.moving = True


def test_requests_draining_after_a_cut_are_reported_as_they_drain(tmp_path: Path) -> None:
    """The book counts a cut share as held until the worker reports its requests drained below it: each
    step of the drain is reported, none below the new share."""
    slot, me = _open(tmp_path, 8), WorkerCollector.get().worker
    loop, limit = WorkerCollector.get().loop, slot.ctx.limit
    slot.start(0, 100)
    slot.apply(me, {"grants": {me: [1, 8]}})
    for _ in range(8):
        asyncio.run_coroutine_threadsafe(limit.acquire(), loop).result(timeout=5)
    assert slot.next_report(me, 0.0) is not None
    slot.apply(me, {"grants": {me: [2, 3]}})  # cut to 3 with 8 in flight
    seen = [slot.next_report(me, 0.01)]
    for step in range(7):
        loop.call_soon_threadsafe(limit.release)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=5)
        seen.append(slot.next_report(me, 0.02 + step / 100))
    in_use = [r["in_use"] if r else None for r in seen]
    assert in_use == [8, 7, 6, 5, 4, 3, None, None], in_use
    loop.call_soon_threadsafe(limit.release)


def test_a_replica_this_worker_takes_out_is_reported_at_once(tmp_path: Path) -> None:
    slot, me = _open(tmp_path, {A: 4, B: 4}), WorkerCollector.get().worker
    slot.start(0, 100)
    slot.apply(me, {"grants": {me: [1, 8]}})  # its share stays 8 whichever replicas are in
    assert slot.next_report(me, 0.0) is not None
    pool = slot.ctx.pool
    pool.failed(pool.endpoint(B), "connect", refused=True)
    report = slot.next_report(me, 0.1)
    assert report is not None and report["rotation"][B][0] == "out", report and report["rotation"]


def test_a_report_that_may_not_have_arrived_is_sent_again(tmp_path: Path) -> None:
    """An exchange that failed may have lost its report: the next one carries a report, though nothing
    changed and REPORT_S has not passed."""
    collector, link = WorkerCollector.get(), CountingLink()
    slot = asyncio.run_coroutine_threadsafe(collector._slot(_run(tmp_path, link, 8)), collector.loop).result(
        timeout=30
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not link.reports:
        time.sleep(0.01)
    link.fail = 1
    failed_at = link.exchanges + 1
    while time.monotonic() < deadline and link.exchanges < failed_at + 2:
        time.sleep(0.01)
    try:
        assert [n for n, _ in link.reports][:2] == [1, failed_at + 1], (failed_at, link.reports[:3])
    finally:
        link.ended = True
    assert slot.written is not None
