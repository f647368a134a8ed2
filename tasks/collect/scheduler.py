"""The one chunk scheduler of every runner: a bounded number of chunks in flight, the next one started as
soon as one ends, all of them stopped at the deadline or when the run is cancelled.

Where a chunk runs is the caller's `RunChunk`: a Prefect task in this process (the local runner), or a
task submitted to Dask or Ray whose completion comes back through the engine's done callback. Nothing
here polls: each chunk is one asyncio task that wakes when its chunk ends, so the cost of a completion
does not grow with the number of chunks, pending or done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.collect.rows import ChunkSpec

log = logging.getLogger(__name__)
RunChunk = Callable[[ChunkSpec], Awaitable[ChunkOutcome]]
Fatal = Callable[[Exception], Exception]


@dataclass
class Scheduled:
    """What the scheduler saw: each finished chunk's outcome or error, and whether the deadline stopped it."""

    outcomes: list[ChunkOutcome] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    stopped: bool = False
    peak_running: int = 0
    started: set[int] = field(default_factory=set)  # chunk indices handed to `run`
    target_reached: bool = False  # `enough` said so: the chunks left were never started


class ChunkCancelled(Exception):
    """A chunk's task was cancelled by its engine (not by this run): the chunk counts as failed."""


def stopping() -> bool:
    """Whether the current chunk's task is being cancelled: the run stops (its deadline, Ctrl-C)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _keep(exc: Exception) -> Exception:
    return exc


async def run_chunks(
    chunks: Iterable[ChunkSpec],
    run: RunChunk,
    in_flight: int,
    deadline_s: float | None = None,
    error: Fatal = _keep,
    enough: Callable[[list[ChunkOutcome]], bool] | None = None,
) -> Scheduled:
    """Run every chunk through `run`, at most `in_flight` at once, until done or `deadline_s` passes.

    A chunk that raises is counted as that chunk's error (`error` may re-raise instead, e.g. for a signal).
    At the deadline, or when this coroutine is cancelled, every running chunk is cancelled and awaited
    before this returns or raises, so no chunk of the run outlives it. `enough` (the outcomes so far)
    stops the starting of chunks once it holds (--until-learnable); the chunks running then finish.
    """
    done = Scheduled()
    gate = asyncio.Semaphore(max(1, in_flight))
    running = 0

    async def one(chunk: ChunkSpec) -> None:
        nonlocal running
        running += 1
        done.peak_running = max(done.peak_running, running)
        try:
            done.outcomes.append(await run(chunk))
        except Exception as exc:  # the chunk failed after its retries; the audit reports the gap
            failure = error(exc)  # a signal is raised here: the run stops, its chunks are not abandoned
            if stopping():  # raised while the deadline or Ctrl-C unwound it: a stop, not its failure
                log.warning(
                    "chunk %d stopped with the run, raising %s: %s", chunk.index, type(exc).__name__, exc
                )
                raise asyncio.CancelledError from exc
            hub.emit(ProgressEvent("abandoned", chunk=chunk.index))
            done.errors.append(failure)
        except asyncio.CancelledError:
            # A future cancelled by its engine reads back as CancelledError: that chunk's failure, unless
            # this run itself is being cancelled (the deadline or Ctrl-C), which must go on.
            if stopping():
                raise
            failure = error(ChunkCancelled(f"chunk {chunk.index}: its task was cancelled"))
            hub.emit(ProgressEvent("abandoned", chunk=chunk.index))
            done.errors.append(failure)
        finally:
            running -= 1
            gate.release()

    try:
        async with asyncio.timeout(deadline_s), asyncio.TaskGroup() as group:
            for chunk in chunks:
                await gate.acquire()
                if enough is not None and enough(done.outcomes):
                    done.target_reached = True
                    gate.release()
                    break
                done.started.add(chunk.index)
                group.create_task(one(chunk))
    except TimeoutError:
        done.stopped = True
    return done
