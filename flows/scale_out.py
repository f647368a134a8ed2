"""chunked-collect on many processes: chunk tasks go to Dask or Ray workers through Prefect's task runners,
and this process keeps the run's share book (one limit for all workers) and counts their progress.

The blocking engine calls run in a thread that stops when told (deadline, lease lost, Ctrl-C): it cancels
the futures and leaves the runner, which closes a local cluster's workers. Workers of an existing cluster
stop their chunk themselves at the deadline or when the run's lease is gone (tasks/scaleout/scope.py).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rollflow.flows.engines import open_engine
from rollflow.flows.secrets import resolve_secret_blocks
from rollflow.settings import RunSpec, redact
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.scaleout.board import Board
from rollflow.tasks.scaleout.collector import POLL_S
from rollflow.tasks.scaleout.scope import WorkerScope
from rollflow.tasks.wrappers.prefect_tasks import collect_chunk_remote_task

WATCH_S = 0.02
SUBMIT_S = 0.05


@dataclass
class CollectResult:
    outcomes: list[ChunkOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # chunk tasks that failed after their retries
    stopped: bool = False
    book_errors: list[str] = field(default_factory=list)  # share book rounds that failed (no chunk's)
    workers: list[dict[str, Any]] = field(default_factory=list)  # per worker process (remote runners)
    peak_in_flight: int | None = None  # remote runners: the most the workers had in flight at once
    peak_allowed: int | None = None  # remote runners: the most the share book let them have at once


def _collect_blocking(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    limits: dict[str, int],
    retries: int,
    scope: WorkerScope,
    stop: threading.Event,
    loop: asyncio.AbstractEventLoop,
) -> CollectResult:
    result = CollectResult()
    with open_engine(spec, f"{secrets.token_hex(6)}", len(chunks)) as engine:
        board = Board(engine.channel, limits, loop)
        task = collect_chunk_remote_task.with_options(retries=retries)
        params = {"share": limits, "scope": scope, "resolve": resolve_secret_blocks, "link": engine.link}
        unsent = list(chunks)
        pending: list[Any] = []
        next_round = 0.0
        while (pending or unsent) and not stop.wait(WATCH_S):
            if time.monotonic() >= next_round:
                next_round = time.monotonic() + POLL_S
                _board_round(board, result)
            # Submitting costs ~0.1 s a chunk in Prefect: a few per tick, so the book never waits on it.
            sent_until = time.monotonic() + SUBMIT_S
            while unsent and time.monotonic() < sent_until:
                pending.append(engine.runner.submit(task, {"spec": spec, "chunk": unsent.pop(0), **params}))
            for future in [f for f in pending if engine.done(f)]:
                pending.remove(future)
                try:
                    outcome = future.result()
                    result.outcomes.append(outcome)
                    board.finish(outcome)
                except Exception as exc:
                    result.errors.append(redact.redact(f"{type(exc).__name__}: {exc}"))
        if pending or unsent:
            engine.cancel(pending)
            result.stopped = True
        _board_round(board, result)
        result.workers = board.workers(result.outcomes)
        result.peak_in_flight = board.book.peak_in_flight
        result.peak_allowed = board.book.peak_held
    return result


def _board_round(board: Board, result: CollectResult) -> None:
    """A failed round is retried at the next tick; workers keep their shares meanwhile."""
    try:
        board.round()
    except Exception as exc:
        note = redact.redact(f"share book round failed: {type(exc).__name__}: {exc}")
        if note not in result.book_errors:
            result.book_errors.append(note)


async def collect_remote(
    spec: RunSpec,
    chunks: list[ChunkSpec],
    limits: dict[str, int],
    retries: int,
    deadline_s: float | None = None,
    owner: str | None = None,
    margin_s: float = 0.0,
) -> CollectResult:
    """`limits` are the run's per-endpoint limits; the workers share them through the share book.

    Stopped at `deadline_s` or by cancellation; either way the thread is awaited before this returns
    or raises, so no chunk of this run is still running when it does.
    """
    stop = threading.Event()
    stop_at = None if deadline_s is None else time.time() + deadline_s
    scope = WorkerScope(stop_at=stop_at, owner=owner, margin_s=margin_s)
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(
        asyncio.to_thread(_collect_blocking, spec, chunks, limits, retries, scope, stop, loop)
    )
    cancelled = False
    try:
        await asyncio.wait({work}, timeout=deadline_s)
    except asyncio.CancelledError:
        cancelled = True
    stop.set()
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return work.result()
