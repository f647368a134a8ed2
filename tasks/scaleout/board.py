"""The flow's side of the share book: each round reads the workers' reports, allocates their shares over
the replicas in rotation, publishes the answer and turns the reports into progress events."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.scaleout.book import ShareBook

# The book's answer is published when it changes (workers read it at every exchange anyway), and at least
# this often: a board deleted under a live run is back within it (workers that find it gone keep their
# running chunks' shares meanwhile), and a Ray cluster's next run deletes boards left unwritten far longer.
REPUBLISH_S = 1.0
# A report unchanged this long, beside a newer one listing the same chunk, is a dead worker's: its counts are
# no longer shown (a live worker writes one at least every collector.REPORT_S).
SILENT_S = 3.0


@dataclass(frozen=True)
class Entry:
    """A running chunk in a worker's report; `floor` None until the attempt has read its earlier commit."""

    done: int
    failed: int
    attempt: int | None  # None: a worker too old to say
    floor: tuple[int, int] | None


def chunk_entry(counts: list[int]) -> Entry:
    """A report's [done, failed, attempt, floor done, floor failed] (RunSlot._running); a worker of an
    older rollflow on a long-lived cluster sends [done, failed] only, a newer one may send more."""
    attempt = counts[2] if len(counts) > 2 else None
    floor = (counts[3], counts[4]) if len(counts) > 4 else None
    return Entry(counts[0], counts[1], attempt, floor)


class Channel(Protocol):
    """The flow's end of an engine channel (Dask scheduler metadata, the Ray cluster's key-value store)."""

    def reports(self) -> dict[str, dict[str, Any]]: ...

    def publish(self, board: dict[str, Any]) -> None: ...


@dataclass
class Rotation:
    """Which replicas are out for the whole run: the finding the book heard of last wins.

    Each new finding a worker reports (its own, counted by that worker) gets the book's next sequence
    number; workers apply events in that order. No clock is compared: hosts' clocks differ, and a finding
    reported late is not newer than one the book already published.
    """

    events: dict[str, tuple[str, int]] = field(default_factory=dict)  # url -> (state, the book's seq)
    heard: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, url) -> its newest finding
    seq: int = 0

    def merge(self, worker: str, reported: dict[str, Any]) -> None:
        for url, (state, found) in reported.items():
            if found > self.heard.get((worker, url), 0):
                self.heard[(worker, url)] = found
                self.seq += 1
                self.events[url] = (state, self.seq)

    def live_limit(self, limits: dict[str, int]) -> int:
        """The run's limit over the replicas in rotation (all of them when none is)."""
        live = sum(n for url, n in limits.items() if self.events.get(url, ("in", 0))[0] == "in")
        return live or sum(limits.values())


class Board:
    """One round every POLL_S: read the workers' reports, allocate shares, publish them, count progress."""

    def __init__(self, channel: Channel, limits: dict[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.channel, self.limits, self.loop = channel, limits, loop
        self.book = ShareBook(sum(limits.values()))
        self.rotation = Rotation()
        self.finished: set[int] = set()
        self.workers_seen = 0
        self.announced: set[int] = set()  # chunks a report showed running (the rounds' thread)
        self.running: set[int] = set()  # the same, as the loop has heard of them
        self.waiting: dict[int, asyncio.Future[None]] = {}  # chunks submitted, not yet seen running
        self.published: dict[str, Any] | None = None
        self.published_at = 0.0
        self.counts: dict[int, Entry] = {}  # chunk -> what was last emitted of it (the rounds')
        self.owners: dict[int, tuple[int, str]] = {}  # chunk -> (attempt, worker) whose counts are shown
        self.listed: set[tuple[str, int]] = set()  # (worker, chunk) the last round's reports list
        self.replaced: set[tuple[str, int]] = set()  # (worker, chunk) listings another run of it replaced

    def round(self) -> None:
        reports = self.channel.reports()
        for worker, report in reports.items():
            self.book.update(worker, report)
            self.rotation.merge(worker, report.get("rotation") or {})
        self.book.set_limit(self.rotation.live_limit(self.limits))
        grants = self.book.allocate(queued=len(self.waiting))
        answer = {
            "grants": grants,
            "rotation": {url: list(e) for url, e in self.rotation.events.items()},
            "moving": self.book.moving,
        }
        if answer != self.published or time.monotonic() - self.published_at > REPUBLISH_S:
            self.channel.publish(answer)
            self.published, self.published_at = answer, time.monotonic()
        events = self._progress(reports)
        if len(self.book.workers) != self.workers_seen:
            self.workers_seen = len(self.book.workers)
            events.append(ProgressEvent("workers", total=self.workers_seen))
        if events:
            self.loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[ProgressEvent]) -> None:
        """On the loop: a round's events, but a running chunk's counts for chunks that finished since the
        round read them (`finish` ran on the loop in between; its counts are final)."""
        for event in events:
            if event.kind in ("attempt", "rollouts") and event.chunk in self.finished:
                continue
            hub.emit(event)

    def _progress(self, reports: dict[str, dict[str, Any]]) -> list[ProgressEvent]:
        """The running chunks' counts that changed since the last round: a report is read again every
        round until its worker writes the next one, and each event wakes the flow's loop. A chunk's counts
        are its owner's (`_owner`): a worker that died running it reports it until the book drops it."""
        running: dict[int, dict[str, Entry]] = {}
        for worker in self.book.workers:
            for key, counts in (reports.get(worker, {}).get("chunks") or {}).items():
                running.setdefault(int(key), {})[worker] = chunk_entry(counts)
        events = []
        for index, listers in running.items():
            if index not in self.announced:
                self.announced.add(index)
                self.loop.call_soon_threadsafe(self._started, index)
            if index in self.finished:
                continue
            owner = self._owner(index, listers)
            if owner is None:
                continue
            entry = listers[owner]
            if self.counts.get(index) == entry:
                continue
            self.counts[index] = entry
            events.append(ProgressEvent("attempt", chunk=index, done=entry.done, floor=entry.floor))
            events.append(ProgressEvent("rollouts", chunk=index, failed=entry.failed))
        self.listed = {(worker, index) for index, listers in running.items() for worker in listers}
        return events

    def _owner(self, index: int, listers: dict[str, Entry]) -> str | None:
        """The worker running the chunk's newest attempt (the highest listed so far; None while no worker
        lists it: a stale listing, a dead worker's, never counts again). Of one attempt listed twice (its
        engine ran it again after its worker died), the worker that listed it last, or the other when the
        owner's report has not changed for SILENT_S longer than the other's (a dead worker's stays behind
        unchanged until the book counts it gone); a listing replaced so is never shown again. A worker too
        old to say its attempt lists the newest."""
        owner = self.owners.get(index)
        top = max([e.attempt for e in listers.values() if e.attempt is not None] + [owner[0] if owner else 1])
        seen = {
            worker: self.book.workers[worker].seen
            for worker, entry in listers.items()
            if entry.attempt in (top, None) and (worker, index) not in self.replaced
        }
        if not seen:
            return None
        fresh = [worker for worker in seen if (worker, index) not in self.listed]
        if owner is None or owner[0] < top or owner[1] not in seen or fresh:
            pick = max(fresh or seen, key=seen.__getitem__)
        else:
            pick, latest = owner[1], max(seen, key=seen.__getitem__)
            if seen[latest] - seen[pick] > SILENT_S:
                pick = latest
        if owner is not None and owner[0] == top and owner[1] != pick and owner[1] in listers:
            self.replaced.add((owner[1], index))
        self.owners[index] = (top, pick)
        return pick

    def started(self, index: int) -> asyncio.Future[None]:
        """Done once a worker has reported chunk `index` running (on the loop)."""
        future = self.waiting.get(index)
        if future is None:
            future = self.waiting[index] = self.loop.create_future()
            if index in self.running:
                future.set_result(None)
        return future

    def forget(self, index: int) -> None:
        self.waiting.pop(index, None)

    def _started(self, index: int) -> None:
        self.running.add(index)
        future = self.waiting.get(index)
        if future is not None and not future.done():
            future.set_result(None)

    def finish(self, outcome: ChunkOutcome) -> None:
        """On the loop: the chunk's final counts; the rounds' counts of it queued before are dropped."""
        index = outcome.manifest.chunk
        self.finished.add(index)
        hub.emit(ProgressEvent("attempt", chunk=index, done=outcome.manifest.rows))
        hub.emit(ProgressEvent("rollouts", chunk=index, failed=outcome.manifest.failed))
        hub.emit(ProgressEvent("chunk", chunk=index, total=outcome.manifest.stats.get("settled_rollouts", 0)))

    def abandon(self, index: int) -> None:
        """On the loop: a chunk that failed for good; the rounds' counts of it are dropped from now on (the
        scheduler takes what it counted out of the progress)."""
        self.finished.add(index)

    def workers(self, outcomes: list[ChunkOutcome]) -> list[dict[str, Any]]:
        """Each worker process's newest figures: its last report's or its last chunk's, whichever is later."""
        newest = self.book.snapshots()
        for outcome in outcomes:
            snap = outcome.worker
            if snap and snap.get("seq", 0) >= newest.get(snap["worker"], {}).get("seq", -1):
                newest[snap["worker"]] = snap
        return [newest[w] for w in sorted(newest)]
