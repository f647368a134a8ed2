"""The chunk scheduler of every runner: 10,000 one-row chunks through the remote runner's path, with a
bounded number in flight, each completion handled once (never a scan of every pending future per tick),
and a deadline that stops what runs and leaves nothing running.

The engine here is a thread pool standing in for a Dask or Ray cluster (a real cluster pays ~10 ms per
task, 100 s for 10,000); the scheduler, the share book's board and its in-memory channel are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from share_board import ShareBoard

from rollflow.flows import scale_out
from rollflow.settings import RunSpec
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.scheduler import run_chunks
from rollflow.tasks.storage.ledger import ChunkManifest

CHUNKS = 10_000
IN_FLIGHT = 16
URL = "http://127.0.0.1:9"


def chunk(i: int) -> ChunkSpec:
    return ChunkSpec(index=i, first_task=i, num_tasks=1, good_rows=1, byte_offset=0, first_line=i + 1)


def outcome(c: ChunkSpec) -> ChunkOutcome:
    manifest = ChunkManifest(
        chunk=c.index, first_task=c.first_task, num_tasks=1, rows_expected=1, rows=1, failed=0,
        sha256="", bytes=0, started_at="", committed_at="", wall_s=0.0, attempt=1,
    )  # fmt: skip
    return ChunkOutcome(manifest=manifest, skipped=False)


class PlainChunkTask:
    """Stands in for the chunk's Prefect task run (kept in the flow process): these tests time the
    scheduler, and 10,000 task runs would time Prefect's API instead."""

    name = "collect-chunk"

    def with_options(self, **options: Any) -> PlainChunkTask:
        return self

    async def __call__(self, dispatch: Any, c: ChunkSpec) -> ChunkOutcome:
        return await dispatch(c, 1)


class PoolEngine:
    """An engine whose worker is a thread pool; counts every status query the scheduler makes."""

    def __init__(self, work_s: float = 0.0005) -> None:
        self.pool = ThreadPoolExecutor(4)
        self.work_s = work_s
        self.channel = ShareBoard()
        self.link = None
        self.runner = self
        self.queries = 0  # done() polls and watch() registrations
        self.outstanding = 0  # submitted and not yet read back
        self.peak_outstanding = 0
        self.cancelled: list[Any] = []
        self.lock = threading.Lock()

    def _work(self, c: ChunkSpec) -> ChunkOutcome:
        time.sleep(self.work_s)
        if c.index == 7:
            raise RuntimeError("chunk 7 failed")
        return outcome(c)

    def submit(self, fn: Any, name: str, job: Any, c: ChunkSpec, attempt: int) -> Future[ChunkOutcome]:
        with self.lock:
            self.outstanding += 1
            self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        future = self.pool.submit(self._work, c)
        future.add_done_callback(lambda _: self._ended())
        return future

    def result(self, future: Future[ChunkOutcome]) -> ChunkOutcome:
        return future.result()

    def _ended(self) -> None:
        with self.lock:
            self.outstanding -= 1

    def done(self, future: Future[ChunkOutcome]) -> bool:
        self.queries += 1
        return future.done()

    def watch(self, future: Future[ChunkOutcome], fn: Any) -> None:
        self.queries += 1
        future.add_done_callback(lambda _: fn())

    def cancel(self, futures: list[Future[ChunkOutcome]]) -> None:
        self.cancelled += futures
        for future in futures:
            future.cancel()

    def slots(self) -> int:
        return 4


def use_engine(monkeypatch: pytest.MonkeyPatch, engine: PoolEngine, start_s: float = 0.0) -> PoolEngine:
    """`collect_remote` runs its chunks on `engine` (which takes `start_s` to start) as plain calls."""

    @contextlib.contextmanager
    def open_engine(spec: RunSpec, key: str, chunks: int) -> Iterator[PoolEngine]:
        time.sleep(start_s)
        yield engine

    monkeypatch.setattr(scale_out, "open_engine", open_engine)
    monkeypatch.setattr(scale_out, "collect_chunk_remote_task", PlainChunkTask())
    return engine


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[PoolEngine]:
    pool_engine = use_engine(monkeypatch, PoolEngine())
    yield pool_engine
    pool_engine.pool.shutdown(wait=True, cancel_futures=True)


def spec(tmp_path: Path) -> RunSpec:
    return RunSpec(
        input=str(tmp_path / "in.jsonl"),
        output=str(tmp_path / "out"),
        backend={"url": URL},
        runner="dask",
        collection={"chunk_size": 1, "chunks_in_flight": IN_FLIGHT},
    )


async def test_ten_thousand_chunks_each_completion_handled_once(tmp_path: Path, engine: PoolEngine) -> None:
    chunks = [chunk(i) for i in range(CHUNKS)]
    t0 = time.monotonic()
    result = await asyncio.wait_for(scale_out.collect_remote(spec(tmp_path), chunks, {URL: 32}, 0), 120)
    took = time.monotonic() - t0
    assert result.errors == ["RuntimeError: chunk 7 failed"] and not result.stopped
    assert sorted(o.manifest.chunk for o in result.outcomes) == [i for i in range(CHUNKS) if i != 7]
    # One status query per chunk at most: no tick that asks every pending future whether it is done.
    assert engine.queries <= CHUNKS, f"{engine.queries:,} status queries for {CHUNKS:,} chunks"
    assert engine.peak_outstanding <= IN_FLIGHT, f"{engine.peak_outstanding:,} chunks submitted at once"
    print(f"{CHUNKS:,} chunks in {took:.1f} s, {engine.queries:,} status queries")


@pytest.mark.alone  # chunks must finish inside a 0.5 s deadline
async def test_the_deadline_stops_remote_chunks_and_cancels_them(tmp_path: Path, engine: PoolEngine) -> None:
    engine.work_s = 0.05
    chunks = [chunk(i) for i in range(CHUNKS)]
    result = await asyncio.wait_for(scale_out.collect_remote(spec(tmp_path), chunks, {URL: 32}, 0, 0.5), 30)
    assert result.stopped
    assert 0 < len(result.outcomes) < CHUNKS
    assert 0 < len(engine.cancelled) <= IN_FLIGHT  # those running at the deadline, nothing unsubmitted


async def test_local_chunks_run_a_bounded_number_at_once() -> None:
    """The local runner's side: the same scheduler, with its chunks in this event loop."""
    running = peak = 0

    async def run(c: ChunkSpec) -> ChunkOutcome:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        running -= 1
        if c.index == 7:
            raise RuntimeError("chunk 7 failed")
        return outcome(c)

    done = await run_chunks((chunk(i) for i in range(CHUNKS)), run, IN_FLIGHT)
    assert len(done.outcomes) == CHUNKS - 1 and [str(e) for e in done.errors] == ["chunk 7 failed"]
    assert peak == IN_FLIGHT == done.peak_running and not done.stopped


class CancellingEngine(PoolEngine):
    """Chunks 0 and 1 come back as futures their engine cancelled before the scheduler watched them."""

    def submit(self, fn: Any, name: str, job: Any, c: ChunkSpec, attempt: int) -> Future[ChunkOutcome]:
        if c.index in (0, 1):
            cancelled: Future[ChunkOutcome] = Future()
            cancelled.cancel()
            return cancelled
        return super().submit(fn, name, job, c, attempt)


async def test_a_chunk_whose_future_was_cancelled_is_counted_and_the_rest_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cancelling = use_engine(monkeypatch, CancellingEngine(work_s=0.01))
    run = spec(tmp_path)
    run.collection.chunks_in_flight = 2
    try:
        result = await asyncio.wait_for(
            scale_out.collect_remote(run, [chunk(i) for i in range(10)], {URL: 32}, 0), 30
        )
    finally:
        cancelling.pool.shutdown(wait=True)
    assert sorted(o.manifest.chunk for o in result.outcomes) == [2, 3, 4, 5, 6, 8, 9]
    assert sorted(result.errors) == [
        "ChunkCancelled: chunk 0: its task was cancelled",
        "ChunkCancelled: chunk 1: its task was cancelled",
        "RuntimeError: chunk 7 failed",
    ]


async def test_a_chunk_that_fails_for_good_leaves_the_progress_count() -> None:
    """Its attempts counted rollouts as they came, but it commits none: the progress every display shows
    goes back to what the dataset holds of it (an earlier, partly failed commit stands). A chunk that failed
    once and then committed keeps its final counts."""
    count = RolloutCount(total=300)
    unsubscribe = hub.subscribe(count.add)

    async def run(c: ChunkSpec) -> ChunkOutcome:
        floor = (40, 1) if c.index == 1 else (0, 0)  # chunk 1 re-runs an earlier commit's failures
        hub.emit(ProgressEvent("attempt", chunk=c.index, done=floor[0], floor=floor))
        hub.emit(ProgressEvent("rollouts", chunk=c.index, done=8, failed=2))
        if c.index == 0:  # its second attempt adopts 3 saved parts, then commits
            hub.emit(ProgressEvent("attempt", chunk=c.index, done=3))
            hub.emit(ProgressEvent("rollouts", chunk=c.index, done=7))
            hub.emit(ProgressEvent("chunk", chunk=c.index))
            return outcome(c)
        raise RuntimeError(f"chunk {c.index} failed after its retries")

    try:
        done = await run_chunks((chunk(i) for i in range(3)), run, 2)
    finally:
        unsubscribe()
    assert len(done.outcomes) == 1 and len(done.errors) == 2
    assert (count.done, count.failed, count.chunks) == (3 + 7 + 40, 1, {}), (
        count.done,
        count.failed,
        count.chunks,
    )


class Stopping(Exception):
    """Stands for the signal `flows.stops.chunk_error` re-raises (a KeyboardInterrupt would stop pytest)."""


async def test_a_chunk_stopped_by_a_signal_keeps_its_counts() -> None:
    """Ctrl-C while a chunk's task unwinds stops the run (`error` raises the signal instead of counting a
    failure); the chunk is not abandoned (its parts are saved and a re-run adopts them), so its counts stay,
    as a deadline's do."""
    count = RolloutCount(total=100)
    unsubscribe = hub.subscribe(count.add)

    async def run(c: ChunkSpec) -> ChunkOutcome:
        hub.emit(ProgressEvent("attempt", chunk=c.index, done=0))
        hub.emit(ProgressEvent("rollouts", chunk=c.index, done=70))
        raise RuntimeError("the task's crash handling failed while the signal unwound it")

    def stop(exc: Exception) -> Exception:
        raise Stopping from exc

    try:
        with pytest.raises(ExceptionGroup) as raised:
            await run_chunks([chunk(0)], run, 1, error=stop)
    finally:
        unsubscribe()
    assert raised.group_contains(Stopping)
    assert count.done == 70 and count.chunks == {0: [70, 0]}, (count.done, count.chunks)


class ReportingEngine(PoolEngine):
    """Chunk 3's worker reports it running with 40 rollouts counted, later with 50, and its attempt fails
    right after that report: the rounds read the 50 only after the flow heard of the failure."""

    def _work(self, c: ChunkSpec) -> ChunkOutcome:
        if c.index != 3:
            return outcome(c)
        for n, done in ((1, 40), (2, 50)):
            if n == 2:
                time.sleep(1.5 * scale_out.POLL_S)  # a round reads the 40
            report = {"n": n, "demand": 0, "in_use": 0, "applied_seq": 0, "applied": 0}
            self.channel.exchange("w", {**report, "chunks": {"3": [done, 0, 1]}})
        raise RuntimeError("chunk 3 failed")


@pytest.mark.alone  # orders a failure before a round by sleeps
async def test_a_remote_chunk_that_fails_for_good_is_not_counted_back_by_later_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reporting = use_engine(monkeypatch, ReportingEngine())
    monkeypatch.setattr(scale_out, "POLL_S", 0.5)  # the flow hears of the failure well before the next round
    count = RolloutCount(total=6)
    unsubscribe = hub.subscribe(count.add)
    try:
        result = await asyncio.wait_for(
            scale_out.collect_remote(spec(tmp_path), [chunk(i) for i in range(6)], {URL: 32}, 0), 30
        )
    finally:
        unsubscribe()
        reporting.pool.shutdown(wait=True)
    assert result.errors == ["RuntimeError: chunk 3 failed"]
    assert (count.done, count.chunks) == (5, {}), (count.done, count.chunks)


async def test_a_chunk_its_engine_cancelled_is_abandoned_and_one_the_deadline_unwinds_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A future its engine cancelled reads back as CancelledError: that chunk failed, its counts leave the
    progress. A chunk whose unwinding at the deadline raised an error of its own (its last flush failed) was
    stopped, not failed: its counts stay, as every chunk's at a deadline."""
    count = RolloutCount(total=200)
    unsubscribe = hub.subscribe(count.add)

    async def run(c: ChunkSpec) -> ChunkOutcome:
        hub.emit(ProgressEvent("attempt", chunk=c.index, done=0))
        hub.emit(ProgressEvent("rollouts", chunk=c.index, done=60))
        if c.index == 0:
            raise asyncio.CancelledError  # its engine's doing: nothing cancelled this run
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise OSError("the last part write failed while the deadline stopped the chunk") from None
        return outcome(c)

    try:
        done = await run_chunks([chunk(0), chunk(1)], run, 2, deadline_s=0.3)
    finally:
        unsubscribe()
    assert done.stopped and [type(e).__name__ for e in done.errors] == ["ChunkCancelled"], done.errors
    assert (count.done, count.chunks) == (60, {1: [60, 0]}), (count.done, count.chunks)
    assert "chunk 1 stopped with the run, raising OSError: the last part write failed" in caplog.text


class SlowStartEngine(PoolEngine):
    """An engine that takes ENGINE_START_S to start; its worker, whose clock runs 1 s ahead of the flow's,
    stops a chunk at the run's deadline as a worker does (`WorkerScope.stop_at`, collector.py), raising
    TimeoutError."""

    def submit(self, fn: Any, name: str, job: Any, c: ChunkSpec, attempt: int) -> Future[ChunkOutcome]:
        return self.pool.submit(self._stopped_at, job.scope.stop_at)

    @staticmethod
    def _stopped_at(stop_at: float) -> ChunkOutcome:
        time.sleep(max(0.0, stop_at - (time.time() + 1.0)))
        raise TimeoutError


ENGINE_START_S = 1.0
REMOTE_DEADLINE_S = 3.0


@pytest.mark.alone  # times the stop against the deadline
async def test_a_remote_deadline_counts_from_the_run_and_stops_chunks_before_their_workers_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's start counts against the deadline on both sides, and the flow stops the run's chunks
    first, though the worker's clock runs ahead: they end stopped, none failed (workers of an existing
    cluster stop themselves a little later)."""
    slow = use_engine(monkeypatch, SlowStartEngine(), ENGINE_START_S)
    t0 = time.monotonic()
    try:
        result = await asyncio.wait_for(
            scale_out.collect_remote(
                spec(tmp_path), [chunk(i) for i in range(4)], {URL: 32}, 0, REMOTE_DEADLINE_S
            ),
            30,
        )
    finally:
        slow.pool.shutdown(wait=False, cancel_futures=True)
    took = time.monotonic() - t0
    assert result.stopped and result.errors == [], result.errors
    # Counted from the engine's start, the deadline would end the run at REMOTE_DEADLINE_S + ENGINE_START_S.
    assert took < REMOTE_DEADLINE_S + ENGINE_START_S / 2, (
        f"stopped {took:.2f} s after a {REMOTE_DEADLINE_S} s deadline"
    )
