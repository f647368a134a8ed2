"""chunked-collect on many processes: chunk tasks go to Dask or Ray workers through Prefect's task runners,
and this process keeps the run's share book (one limit for all workers) and counts their progress.

The chunks are scheduled as the local runner's are (tasks/collect/scheduler.py): a bounded number in
flight, each awaited through the engine's done callback, never polled. The engine's blocking calls
(entering the runner, submitting, reading a result, leaving) run on one thread of their own; the share
book's rounds on another, so a slow submission never delays the book. At the deadline, or when the run is
cancelled, the futures still running are cancelled and the runner is left (which closes a local cluster's
workers) before this returns or raises. Workers of an existing cluster stop their chunk themselves
WORKER_STOP_GRACE_S after the deadline (which counts from before the engine's start, on both sides) or
when the run's lease is gone (tasks/scaleout/scope.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollflow.flows.engines import Engine, open_engine
from rollflow.flows.secrets import worker_secrets
from rollflow.settings import RunSpec, redact
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.plan import SMALL_REMOTE_CHUNK_ROLLOUTS
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.scheduler import Scheduled, run_chunks, stopping
from rollflow.tasks.scaleout.board import Board
from rollflow.tasks.scaleout.collector import POLL_S, RemoteRun
from rollflow.tasks.scaleout.scope import WorkerScope
from rollflow.tasks.wrappers.prefect_tasks import collect_chunk_remote_task
from rollflow.tasks.wrappers.worker_chunks import AttemptFailed, collect_remote_chunk

log = logging.getLogger(__name__)
T = TypeVar("T")
# Chunks submitted ahead at least: a worker that joins, or a cluster that adapts, finds them queued.
MIN_REMOTE_IN_FLIGHT = 64
WORKER_STOP_GRACE_S = 2.0  # workers stop a run's chunks this long after its deadline (see collect_remote)


@dataclass
class CollectResult:
    outcomes: list[ChunkOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # chunk tasks that failed after their retries
    stopped: bool = False
    book_errors: list[str] = field(default_factory=list)  # share book rounds that failed (no chunk's)
    workers: list[dict[str, Any]] = field(default_factory=list)  # per worker process (remote runners)
    peak_in_flight: int | None = None  # remote runners: the most the workers had in flight at once
    peak_allowed: int | None = None  # remote runners: the most the share book let them have at once
    started: set[int] = field(default_factory=set)  # chunks handed to a runner
    target_reached: bool = False  # --until-learnable: the chunks never started are not needed

    @classmethod
    def of(cls, done: Scheduled) -> CollectResult:
        errors = [redact.redact(f"{type(exc).__name__}: {exc}") for exc in done.errors]
        return cls(
            outcomes=done.outcomes,
            errors=errors,
            stopped=done.stopped,
            started=done.started,
            target_reached=done.target_reached,
        )


class EngineThread:
    """The engine's blocking calls, one at a time on a thread of their own, in the flow's context (the
    Prefect flow run the chunk tasks belong to)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollflow-engine")
        self.context = contextvars.copy_context()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(self.context.run, fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class BoardThread:
    """The share book's rounds every POLL_S on a thread of their own, until stopped."""

    def __init__(self, board: Board, notes: list[str]) -> None:
        self.board, self.notes = board, notes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rollflow-share-book", daemon=True)

    def _run(self) -> None:
        while True:
            self.round()
            if self.stop.wait(POLL_S):
                return

    def round(self) -> None:
        """A failed round is retried at the next one; workers keep their shares meanwhile."""
        try:
            self.board.round()
        except Exception as exc:
            note = redact.redact(f"share book round failed: {type(exc).__name__}: {exc}")
            if note not in self.notes:
                self.notes.append(note)

    async def finish(self) -> None:
        """Stop the rounds, then one last round: the workers' newest figures."""
        self.stop.set()
        await asyncio.to_thread(self.thread.join)
        await asyncio.to_thread(self.round)


@dataclass
class RemoteChunks:
    """The engine's side of the scheduler. Each chunk's Prefect task run (`task(dispatch, chunk)`) is kept
    here, in the flow process, with its retries; each attempt goes to a worker as a plain call,
    `fn(job, chunk, attempt)`, wakes when it ends and reads its outcome (and tells the share book, if the
    run keeps one).

    With a share book, a chunk's first attempt is submitted before its task run begins, and the task run
    begins once a worker reports the chunk running (or it has ended): a chunk waiting in the cluster's
    queue is not shown Running in Prefect."""

    engine: Engine
    calls: EngineThread
    board: Board | None
    task: Any
    fn: Callable[..., Any]
    job: Any  # what every chunk of the run brings to its worker
    live: dict[int, Any] = field(default_factory=dict)  # chunk index -> its future, until it ends
    queued: dict[int, tuple[Any, asyncio.Future[None]]] = field(default_factory=dict)  # first attempts

    async def run(self, chunk: Any) -> Any:
        """`chunk`: a ChunkSpec (collection) or any chunk with an `index` (reverify's SourceChunk)."""
        if self.board is not None:
            await self._queue(chunk, self.board)
        try:
            outcome = await self.task(self.dispatch, chunk)
        except (Exception, asyncio.CancelledError):
            if self.board is not None and not stopping():  # failed for good, or its engine cancelled it
                self.board.abandon(chunk.index)
            raise
        if self.board is not None:
            self.board.finish(outcome)
        return outcome

    async def _queue(self, chunk: Any, board: Board) -> None:
        future = await self.calls.call(self._submit, chunk, 1)
        ended = self._ended(future)
        self.queued[chunk.index] = (future, ended)
        started = board.started(chunk.index)
        try:
            await asyncio.wait({ended, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            board.forget(chunk.index)

    async def dispatch(self, chunk: Any, attempt: int) -> Any:
        queued = self.queued.pop(chunk.index, None)
        if queued is not None and attempt == 1:
            future, ended = queued
        else:
            future = await self.calls.call(self._submit, chunk, attempt)
            ended = self._ended(future)
        await ended
        try:
            outcome = await self.calls.call(self.engine.result, future)
        finally:
            self.live.pop(chunk.index, None)
        if isinstance(outcome, AttemptFailed):
            raise outcome.error
        return outcome

    def _submit(self, chunk: Any, attempt: int) -> Any:
        """On the engine's thread: whatever it submitted is known to `cancel_live` after it."""
        future = self.engine.submit(self.fn, self.task.name, self.job, chunk, attempt)
        self.live[chunk.index] = future
        return future

    def cancel_live(self) -> None:
        """On the engine's thread, after the scheduler stopped: the futures of chunks that did not end."""
        if self.live:
            self.engine.cancel(list(self.live.values()))
            self.live.clear()

    def _ended(self, future: Any) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ended.done():
                ended.set_result(None)

        def ring() -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the run is over and its loop closed
                loop.call_soon_threadsafe(wake)

        self.engine.watch(future, ring)
        return ended


async def collect_remote(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    limits: dict[str, int],
    retries: int,
    deadline_s: float | None = None,
    owner: str | None = None,
    margin_s: float = 0.0,
    enough: Callable[[list[ChunkOutcome]], bool] | None = None,
) -> CollectResult:
    """`limits` are the run's per-endpoint limits; the workers share them through the share book.

    Stopped at `deadline_s` or by cancellation; either way the runner is left before this returns or
    raises, so no chunk of this run is still running on a cluster this run started.
    """
    stop_at = None if deadline_s is None else time.time() + deadline_s  # the engine's start counts too
    # Workers stop themselves a little after the flow's deadline: the flow stops its chunks first, so one
    # at the deadline ends stopped, not failed (workers of an existing cluster are not stopped otherwise).
    worker_stop = None if stop_at is None else stop_at + WORKER_STOP_GRACE_S
    scope = WorkerScope(stop_at=worker_stop, owner=owner, margin_s=margin_s)
    calls = EngineThread()
    stack = contextlib.ExitStack()
    try:
        engine = await settled(
            calls.call(stack.enter_context, open_engine(spec, secrets.token_hex(6), len(chunks)))
        )
        return await _collect(spec, chunks, limits, retries, scope, stop_at, engine, calls, enough)
    finally:
        await settled(calls.call(stack.close))
        calls.close()


async def _collect(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    limits: dict[str, int],
    retries: int,
    scope: WorkerScope,
    stop_at: float | None,
    engine: Engine,
    calls: EngineThread,
    enough: Callable[[list[ChunkOutcome]], bool] | None = None,
) -> CollectResult:
    notes: list[str] = []
    assert engine.channel is not None  # opened with its share book
    board = Board(engine.channel, limits, asyncio.get_running_loop())
    job = RemoteRun(spec, scope, worker_secrets(), engine.link, limits)
    task = collect_chunk_remote_task.with_options(retries=retries)
    remote = RemoteChunks(engine, calls, board, task, collect_remote_chunk, job)
    # Many chunks submitted ahead keep every worker fed; with --until-learnable each one submitted is one
    # more collected past the target, so then only two per worker slot.
    floor = 1 if spec.collection.until_learnable is not None else MIN_REMOTE_IN_FLIGHT
    in_flight = spec.collection.chunks_in_flight or max(floor, 2 * await calls.call(engine.slots))
    _say_small_chunks(spec, len(chunks))
    rounds = BoardThread(board, notes)
    rounds.thread.start()
    try:
        left = None if stop_at is None else max(0.0, stop_at - time.time())
        done = await run_chunks(chunks, remote.run, in_flight, left, enough=enough)
    finally:
        await settled(calls.call(remote.cancel_live))
        await settled(rounds.finish())
    result = CollectResult.of(done)
    result.book_errors = notes
    result.workers = board.workers(result.outcomes)
    result.peak_in_flight = board.book.peak_in_flight
    result.peak_allowed = board.book.peak_held
    return result


def _say_small_chunks(spec: RunSpec, chunks: int) -> None:
    """Remote chunks pay a fixed dispatch each (the flow's task run for it, the engine's submission, the
    worker's commit): said once when many small ones will pay it, since the chunk size is the run's
    identity and stays."""
    col = spec.collection
    rollouts = col.chunk_size * col.num_repeats
    if chunks >= 10 and rollouts < SMALL_REMOTE_CHUNK_ROLLOUTS:
        log.warning(
            "--runner %s: %d chunks of %d rollouts; each remote chunk costs about 15-20 ms of CPU to "
            "dispatch, so chunks of %d rollouts or more (--chunk-size) cost less per rollout",
            spec.runner,
            chunks,
            rollouts,
            SMALL_REMOTE_CHUNK_ROLLOUTS,
        )


async def settled(work: Any) -> Any:
    """Await `work` to its end even when cancelled meanwhile; the cancellation is raised after it."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()
