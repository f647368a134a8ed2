"""One collector per worker process (Dask or Ray): every chunk task of a run that lands in the process
hands its work to it.

Chunks of a run then share one event loop, HTTP session, endpoint pool (with its rotation state), S3
filesystem and verifier, as in the local runner; several chunks can be in flight in one process, and a
chunk's tail never idles the process's share. The share itself comes from the flow's share book
(tasks/scaleout/book.py) through a `ShareLink`, a few times a second, never once per request.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.endpoints import split_limit
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.chunk import ChunkOutcome, collect_chunk
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.runtime import RunHandles, collect_context, open_run
from rollflow.tasks.scaleout.book import SHARE_LEASE_S
from rollflow.tasks.scaleout.channels import EXCHANGE_TIMEOUT_S
from rollflow.tasks.scaleout.node import node_sharers
from rollflow.tasks.scaleout.scope import SettingsResolver, WorkerScope
from rollflow.tasks.storage.lease import LeaseLost, OutputGone, follow, owner_fence, run_guarded
from rollflow.tasks.verify.pool import close_pools

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a worker looks whether to exchange with the share book (and does, while shares move)
FOLLOW_S = 1.0  # after its share changed, a worker reads every POLL_S this long (a next move comes soon)
ANSWER_S = 0.3  # after a report that changed what the book allocates by, the same (a round away)
REPORT_S = 1.0  # a worker's report is written at least this often (the book counts silence from it)
IDLE_S = 30.0  # a run with no chunk in this process for this long is closed here (if the book never said so)
EXCHANGE_THREADS = 2  # exchanges run on threads of their own: one stuck never holds a commit's thread


class ShareLink(Protocol):
    """The worker's side of the share book: send this worker's report (None: nothing new to say), get the
    book's newest answer. A link whose exchanges are dear says how often a worker reads a settled book
    (`settled_s`, seconds; none: at every POLL_S)."""

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class RemoteRun:
    """What a chunk task brings to the collector about its run: the spec, what bounds it, how to fill
    its secrets, how to reach its share book, and its limits (per endpoint, or a total)."""

    spec: RunSpec
    scope: WorkerScope
    resolve: SettingsResolver | None
    link: ShareLink | None
    share: int | dict[str, int]


def run_key(run: RemoteRun) -> str:
    """A run as this process knows it: its output and the lease owner it writes for."""
    return f"{run.spec.output}|{run.scope.owner}"


def _past(stop_at: float | None) -> bool:
    return stop_at is not None and time.time() >= stop_at


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class RunSlot:
    """One run's state in this process: what its chunks share, and what the share book hears of it."""

    handles: RunHandles
    ctx: CollectContext
    run_limits: dict[str, int]
    scope: WorkerScope
    link: ShareLink | None
    key: str  # the run's key here; its chunks' progress events carry it
    planned: dict[int, int] = field(default_factory=dict)  # running chunk -> its planned rollouts
    attempts: dict[int, int] = field(default_factory=dict)  # running chunk -> the flow's attempt of it
    floors: dict[int, tuple[int, int]] = field(default_factory=dict)  # running chunk -> its earlier commit's
    counted: RolloutCount = field(default_factory=RolloutCount)  # what this process finished of them
    chunks_done: int = 0
    applied_seq: int = 0
    reports: int = 0
    last_ok: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    cpu0: float = field(default_factory=time.process_time)
    sync: asyncio.Task[None] | None = None
    exchanging: asyncio.Future[dict[str, Any] | None] | None = None  # the exchange under way, if any
    sent_at: float = 0.0  # when it was sent: an answer confirms the share as of then, not as of its arrival
    moving: bool = True  # the book's last answer said shares are on their way (or no live answer came)
    moved_at: float = 0.0  # when the book last changed this worker's share
    changed_at: float = 0.0  # when it last sent a report that changed what the book allocates by
    settled_s: float = 0.0  # how often it reads the book while shares are settled (its link's `settled_s`)
    written: tuple[Any, ...] | None = None  # what the book allocates by, as of the last report sent
    written_at: float = 0.0

    def start(self, chunk: int, planned: int, attempt: int = 1) -> None:
        self.planned[chunk] = planned
        self.attempts[chunk] = attempt
        self.counted.chunks[chunk] = [0, 0]

    def end(self, chunk: int) -> None:
        self.planned.pop(chunk, None)
        self.attempts.pop(chunk, None)
        self.floors.pop(chunk, None)
        self.counted.chunks.pop(chunk, None)

    def count(self, event: ProgressEvent) -> None:
        """A running chunk's attempt or rollouts (the process's hub also carries other runs' events, whose
        chunks have the same indexes). An attempt's adopted rollouts go to the chunk's demand only: they
        were counted where they were collected, so a retried chunk is not counted twice."""
        if event.run != self.key or event.chunk not in self.planned:
            return
        if event.kind == "attempt":
            self.counted.chunks[event.chunk] = [event.done, 0]
            if event.floor is not None:
                self.floors[event.chunk] = event.floor
        elif event.kind == "rollouts":
            self.counted.add(event)

    def carried(self) -> tuple[int, int, int, int, float]:
        """The figures a later slot of the run in this process goes on from (after this one idled out)."""
        return self.counted.done, self.counted.failed, self.chunks_done, self.reports, self.cpu0

    def carry(self, figures: tuple[int, int, int, int, float]) -> None:
        self.counted.done, self.counted.failed, self.chunks_done, self.reports, self.cpu0 = figures

    def report(self, worker: str) -> dict[str, Any]:
        self.reports += 1
        return {
            "n": self.reports,
            "demand": self._demand(),
            "in_use": self.ctx.limit.in_use,
            "applied_seq": self.applied_seq,
            "applied": self._applied(),
            "rotation": self._rotation(),
            "chunks": {str(i): self._running(i) for i in self.counted.chunks},
            "snapshot": self.snapshot(worker),
        }

    def _running(self, chunk: int) -> list[int]:
        """A running chunk as reports carry it: [done, failed, the flow's attempt, and, once the attempt has
        read it, (done, failed) of its earlier commit] (board.chunk_entry reads it)."""
        return [*self.counted.chunks[chunk], self.attempts.get(chunk, 1), *self.floors.get(chunk, ())]

    def next_report(self, worker: str, now: float) -> dict[str, Any] | None:
        """The report to send with this exchange, or None when none is due."""
        state = self.due(now)
        if state is None:
            return None
        report = self.report(worker)
        if state != self.written:
            self.changed_at = now
        self.written, self.written_at = state, now
        return report

    def wants_exchange(self, now: float) -> bool:
        """Whether to exchange with the book now: while shares move (the book's last answer said so, or
        none came), FOLLOW_S after this worker's share last moved, ANSWER_S after a report that changed
        what the book allocates by (the answer it came back with was published before the book read it: a
        worker's first report would otherwise wait `settled_s` for its first share), when a report is due,
        and `settled_s` after the last exchange."""
        if self.moving or now - self.moved_at < FOLLOW_S or now - self.changed_at < ANSWER_S:
            return True
        if now - self.sent_at >= self.settled_s:
            return True
        return self.due(now) is not None

    def due(self, now: float) -> tuple[Any, ...] | None:
        """What the book allocates by, when it changed since the last report or that is REPORT_S old (a
        report is then due); else None. Demand counts up to the run's limit (`_demand`) and in-flight
        requests only above the applied share: beyond those, the book allocates the same.
        The book's `peak_in_flight` is then sampled by these reports, at least once a second."""
        applied = self._applied()
        state = (
            tuple(self.planned),
            self.applied_seq,
            applied,
            max(self.ctx.limit.in_use, applied),
            self._demand(),
            self._rotation(),
        )
        if state != self.written or now - self.written_at >= REPORT_S:
            return state
        return None

    def _left(self) -> int:
        """Rollouts the running chunks still have to finish here."""
        return sum(max(0, n - sum(self.counted.chunks.get(i, ()))) for i, n in self.planned.items())

    def _demand(self) -> int:
        """What is left, up to the run's limit: beyond it the book allocates the same, so reports carry
        it capped and a change above it is no reason to report."""
        return min(self._left(), sum(self.run_limits.values()))

    def _applied(self) -> int:
        pool, limit = self.ctx.pool, self.ctx.limit
        return pool.share if pool.share is not None else limit.limit

    def _rotation(self) -> dict[str, list[Any]]:
        return {url: list(event) for url, event in self.ctx.pool.rotation().items()}

    def snapshot(self, worker: str) -> dict[str, Any]:
        """This process's figures for the run so far (the report's per-worker rows)."""
        return {
            "worker": worker,
            "seq": self.reports,
            "rollouts": self.counted.done,
            "failed": self.counted.failed,
            "chunks": self.chunks_done,
            "peak_in_flight": self.ctx.limit.peak,
            "share": self.ctx.pool.share,
            "cpu_s": round(time.process_time() - self.cpu0, 3),
            "endpoints": self.ctx.pool.rows(),
        }

    def apply(self, worker: str, reply: dict[str, Any]) -> None:
        seq, share = (reply.get("grants") or {}).get(worker, (0, 0))
        if seq > self.applied_seq:
            self.applied_seq = seq
            self.moved_at = time.monotonic()
            self.ctx.pool.set_share(share, self.run_limits)
        for url, (state, seq) in (reply.get("rotation") or {}).items():
            self.ctx.pool.follow(url, state, seq)


class WorkerCollector:
    """The process-wide collector: a daemon thread runs its event loop; runs are keyed by output and owner."""

    _instance: WorkerCollector | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.worker = worker_id()
        self.loop = asyncio.new_event_loop()
        self.slots: dict[str, RunSlot] = {}
        self.carried: dict[str, tuple[int, int, int, int, float]] = {}  # figures of runs' closed slots
        self._opening: dict[str, asyncio.Future[RunSlot]] = {}
        self.exchanges = concurrent.futures.ThreadPoolExecutor(EXCHANGE_THREADS, "rollflow-exchange")
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollflow-collector", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._subscribe(), self.loop).result()

    @classmethod
    def get(cls) -> WorkerCollector:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def run(self, run: RemoteRun, chunk: ChunkSpec, attempt: int) -> ChunkOutcome:
        """Run the chunk on the collector's loop; called from the engine's task thread, which waits."""
        return asyncio.run_coroutine_threadsafe(self._collect(run, chunk, attempt), self.loop).result()

    async def _collect(self, run: RemoteRun, chunk: ChunkSpec, attempt: int) -> ChunkOutcome:
        slot = await self._slot(run)
        slot.start(chunk.index, chunk.good_rows * run.spec.collection.num_repeats, attempt)
        scope = run.scope
        left = None if scope.stop_at is None else max(0.0, scope.stop_at - time.time())
        try:
            async with asyncio.timeout(left):
                work = collect_chunk(slot.ctx, chunk, attempt)
                if scope.owner is None:
                    outcome = await work
                else:
                    watcher = follow(slot.handles.store, scope.owner, scope.check_s, scope.margin_s)
                    outcome = await run_guarded(work, watcher)
            slot.chunks_done += 1
            outcome.worker = slot.snapshot(self.worker)
            outcome.endpoints = outcome.worker["endpoints"]
            return outcome
        except (LeaseLost, OutputGone, TimeoutError) as exc:
            # The run is over (its lease gone, or its deadline passed), and so is its share here: another
            # chunk of it in this process would take the slots this one's cut requests freed, while the
            # backend still serves them (12 in flight of 8 seen after a stop, warm Ray workers).
            if not isinstance(exc, TimeoutError) or _past(scope.stop_at):
                slot.ctx.pool.set_share(0, slot.run_limits)
            raise
        finally:
            slot.end(chunk.index)
            slot.last_active = time.monotonic()

    async def _slot(self, run: RemoteRun) -> RunSlot:
        """The run's slot, opened once however many chunks of it start at the same time."""
        key = run_key(run)
        if key in self.slots:
            return self.slots[key]
        if key not in self._opening:
            self._opening[key] = asyncio.ensure_future(self._open(run))
        try:
            slot = await asyncio.shield(self._opening[key])
        finally:
            if self._opening.get(key) is not None and self._opening[key].done():
                self._opening.pop(key, None)
        if key in self.carried:  # the run's slot idled out here earlier: its figures go on
            slot.carry(self.carried.pop(key))
        self.slots[key] = slot
        if run.link is not None and slot.sync is None:
            slot.sync = asyncio.create_task(self._keep_share(key, slot))
        return slot

    async def _open(self, run: RemoteRun) -> RunSlot:
        settings = RollflowSettings()
        if run.resolve is not None:
            settings = await run.resolve(settings)
        handles = open_run(run.spec, settings)
        if run.scope.owner is not None:
            handles.ledger.fence = owner_fence(handles.store, run.scope.owner, run.scope.margin_s)
        sharers = await asyncio.to_thread(node_sharers)
        ctx = collect_context(handles, settings, run.share, shared=run.link is not None, sharers=sharers)
        ctx.run = run_key(run)
        urls = run.spec.backend.urls
        limits = run.share if isinstance(run.share, dict) else split_limit(run.share, urls)
        settled_s = getattr(run.link, "settled_s", 0.0)
        return RunSlot(
            handles,
            ctx,
            {url: limits[url] for url in urls},
            run.scope,
            run.link,
            ctx.run,
            settled_s=settled_s,
        )

    async def _keep_share(self, key: str, slot: RunSlot) -> None:
        """Exchange with the book when `wants_exchange` says so (it looks every POLL_S), with a report when
        one is due, until the book says the run ended, or the run has had no chunk here for IDLE_S (or is
        past its deadline)."""
        warned = False
        while True:
            # A share not confirmed for SHARE_LEASE_S is dropped before this worker reports again (after a
            # pause of the process too): the book may have counted it gone and given its share away.
            if time.monotonic() - slot.last_ok > SHARE_LEASE_S and slot.ctx.pool.share:
                slot.ctx.pool.set_share(0, slot.run_limits)
            try:
                if slot.wants_exchange(time.monotonic()) and self._answer(
                    key, slot, await self._exchange(slot)
                ):
                    return
            except Exception as exc:
                slot.moving = True
                if not warned:
                    log.warning("cannot reach the run's share book: %s: %s", type(exc).__name__, exc)
                    warned = True
            now = time.monotonic()
            past_deadline = slot.scope.stop_at is not None and time.time() > slot.scope.stop_at
            if not slot.planned and (now - slot.last_active > IDLE_S or past_deadline):
                self._close_slot(key, slot)
                return
            await asyncio.sleep(POLL_S)

    def _answer(self, key: str, slot: RunSlot, reply: dict[str, Any] | None) -> bool:
        """Apply the book's answer; True when it ended the run here (its slot is closed).

        Only a board confirms the share. A board gone under running chunks may be back within the book's
        next publish (the chunks keep their share until SHARE_LEASE_S); with none running the run ended."""
        if reply and (reply.get("closed") or (reply.get("gone") and not slot.planned)):
            slot.ctx.pool.set_share(0, slot.run_limits)
            self._close_slot(key, slot)
            return True
        if reply and not reply.get("gone"):
            slot.last_ok = slot.sent_at
            slot.apply(self.worker, reply)
            slot.moving = bool(reply.get("moving", True))
        else:
            slot.written = None  # no live board took the last report: the next exchange sends one
            slot.moving = True
        return False

    def _close_slot(self, key: str, slot: RunSlot) -> None:
        if self.slots.get(key) is slot:
            self.slots.pop(key)
            self.carried[key] = slot.carried()

    async def _exchange(self, slot: RunSlot) -> dict[str, Any] | None:
        """One exchange on the exchange threads, with a report only when one is due (`RunSlot.due`); one
        still under way (a scheduler that does not answer) is awaited again rather than joined by another,
        so stuck exchanges never pile up."""
        assert slot.link is not None
        if slot.exchanging is None or slot.exchanging.done():
            slot.sent_at = time.monotonic()
            report = slot.next_report(self.worker, slot.sent_at)
            slot.exchanging = self.loop.run_in_executor(
                self.exchanges, slot.link.exchange, self.worker, report
            )
        try:
            return await asyncio.wait_for(asyncio.shield(slot.exchanging), EXCHANGE_TIMEOUT_S)
        except Exception:
            slot.written = None  # the report may not have arrived: the next exchange sends one
            raise

    async def _subscribe(self) -> None:
        hub.subscribe(self._count)

    def _count(self, event: ProgressEvent) -> None:
        for slot in self.slots.values():
            slot.count(event)

    def close(self) -> None:
        """At process exit: close the loop's HTTP session and this process's verifier processes."""
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_loop_session(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=1)  # no exchange is started on the threads shut down below
        self.exchanges.shutdown(wait=False, cancel_futures=True)
        close_pools()
