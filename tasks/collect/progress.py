"""Progress events from collection to whoever displays them (the CLI bar, Prefect artifacts)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Listener = Callable[["ProgressEvent"], None]


@dataclass(slots=True)
class ProgressEvent:
    # "plan", "attempt" (a chunk attempt starts with `done` adopted), "rollouts", "chunk" (committed),
    # "abandoned" (failed for good), "workers" (Dask or Ray: `total` worker processes report to the run now),
    # "resume" (the output already holds `done` of the run's `total` rollouts), "stage" (`text` says what
    # the run is doing before its rollouts come: scanning, starting verifier processes, ...)
    kind: str
    total: int = 0
    done: int = 0
    failed: int = 0
    chunk: int | None = None
    run: str | None = None  # the run the chunk belongs to, where one process serves several (a worker)
    # "attempt": (done, failed) of the chunk's earlier commit that stands (a resumed run redoing its
    # failures), where its count goes back if it is abandoned; None: not known yet, the last one holds
    floor: tuple[int, int] | None = None
    text: str = ""


@dataclass
class RolloutCount:
    """Planned rollouts finished, each counted once: the count every progress display shows.

    Only chunks' rollouts count (a probe's counts when its chunk adopts it). A chunk's new attempt
    restarts its count from what it adopted, so a retried chunk never counts a rollout twice: its
    saved rollouts come back as adopted, its failures are asked again. A committed chunk is final.
    """

    total: int = 0
    done: int = 0
    failed: int = 0
    workers: int = 0  # worker processes in use (remote runners; 0 when chunks run in this process)
    chunks: dict[int, list[int]] = field(default_factory=dict)  # running chunk -> [done, failed]
    floors: dict[int, tuple[int, int]] = field(default_factory=dict)  # running chunk -> its earlier commit's

    def add(self, event: ProgressEvent) -> bool:
        """Apply one event; True when the count changed."""
        if event.kind == "plan":
            self.total = event.total
            return True
        if event.kind == "workers":
            self.workers = event.total
            return True
        if event.chunk is None:
            return False
        if event.kind == "attempt":
            old = self.chunks.get(event.chunk, [0, 0])
            self.done += event.done - old[0]
            self.failed -= old[1]
            self.chunks[event.chunk] = [event.done, 0]
            if event.floor is not None:
                self.floors[event.chunk] = event.floor
            return True
        if event.kind == "rollouts":
            mine = self.chunks.setdefault(event.chunk, [0, 0])
            mine[0] += event.done
            mine[1] += event.failed
            self.done += event.done
            self.failed += event.failed
            return True
        if event.kind == "abandoned":  # back to what the dataset holds of it: its earlier commit, if any
            old = self.chunks.pop(event.chunk, [0, 0])
            done, failed = self.floors.pop(event.chunk, (0, 0))
            self.done += done - old[0]
            self.failed += failed - old[1]
            return True
        if event.kind == "chunk":  # committed; `total`: its rollouts settling left out of the plan
            self.chunks.pop(event.chunk, None)
            self.floors.pop(event.chunk, None)
            self.total -= event.total
            return bool(event.total)
        return False

    @property
    def finished(self) -> int:
        return self.done + self.failed


@dataclass
class ProgressHub:
    """Fan-out of progress events; listeners must be cheap (called from the event loop)."""

    listeners: list[Listener] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)  # listeners whose error was logged already

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def emit(self, event: ProgressEvent) -> None:
        """A listener's error is logged once and dropped: a display must never fail the chunk emitting."""
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:
                if id(listener) not in self.failed:
                    self.failed.add(id(listener))
                    log.warning(
                        "progress listener %r failed; its errors are ignored", listener, exc_info=True
                    )


hub = ProgressHub()


def resume_text(done: int, total: int) -> str:
    """What a resumed run says first: how much of it the output already holds."""
    return f"resuming: {done:,} of {total:,} rollouts already committed"
