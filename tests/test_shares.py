"""The share book: workers' shares follow their work, and what they can have in flight never sums past the
limit, whatever order reports, answers and requests come in."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from share_board import ShareBoard

from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub
from rollflow.tasks.scaleout import book as book_module
from rollflow.tasks.scaleout.board import SILENT_S, Board, Entry, chunk_entry
from rollflow.tasks.scaleout.book import NEXT_CHUNK_S, ShareBook, water_fill
from rollflow.tasks.storage.ledger import ChunkManifest


def test_water_fill_splits_evenly_and_never_past_a_demand():
    assert water_fill(32, {"a": 100, "b": 100}, {}) == {"a": 16, "b": 16}
    assert water_fill(32, {"a": 5, "b": 100}, {}) == {"a": 5, "b": 27}
    assert water_fill(32, {"a": 0, "b": 100}, {}) == {"a": 0, "b": 32}
    assert water_fill(8, {"a": 1, "b": 2}, {}) == {"a": 1, "b": 2}  # the rest stays free


def test_water_fill_keeps_an_odd_unit_where_it_is():
    assert water_fill(3, {"a": 9, "b": 9}, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert water_fill(1, {"a": 9, "b": 9, "c": 9}, {"c": 1}) == {"a": 0, "b": 0, "c": 1}


def test_a_share_moves_only_after_its_holder_drained():
    book = ShareBook(32)
    book.update("a", {"n": 1, "demand": 1000}, now=0)
    assert book.allocate(now=0)["a"][1] == 32
    book.update("a", {"n": 2, "demand": 1000, "in_use": 32, "applied_seq": 1, "applied": 32}, now=0.1)
    book.update("b", {"n": 1, "demand": 1000}, now=0.1)
    grants = book.allocate(now=0.1)
    assert grants["a"][1] == 16 and grants["b"][1] == 0  # a is told to shrink; b waits for a to drain
    book.update("a", {"n": 3, "demand": 1000, "in_use": 20, "applied_seq": 2, "applied": 16}, now=0.2)
    assert book.allocate(now=0.2)["b"][1] == 12  # what a no longer holds, not yet all of its half
    book.update("a", {"n": 4, "demand": 1000, "in_use": 16, "applied_seq": 2, "applied": 16}, now=0.3)
    assert book.allocate(now=0.3)["b"][1] == 16


def test_a_raise_not_yet_reported_still_counts():
    """a was raised to 10 and may run 10 before it reports again: b gets nothing of those 10 meanwhile."""
    book = ShareBook(10)
    book.update("a", {"n": 1, "demand": 50}, now=0)
    assert book.allocate(now=0)["a"] == (1, 10)
    book.update("b", {"n": 1, "demand": 50}, now=0.1)
    grants = book.allocate(now=0.1)
    assert grants["a"][1] == 5 and grants["b"][1] == 0


def test_a_silent_worker_is_gone_and_its_share_freed():
    book = ShareBook(10, lost_s=5)
    book.update("a", {"n": 1, "demand": 50}, now=0)
    book.allocate(now=0)
    book.update("a", {"n": 2, "demand": 50, "in_use": 10, "applied_seq": 1, "applied": 10}, now=1)
    book.update("b", {"n": 1, "demand": 50}, now=1)
    assert book.allocate(now=1)["b"][1] == 0
    book.update("b", {"n": 2, "demand": 50}, now=7)
    book.update(
        "a", {"n": 2, "demand": 50, "in_use": 10, "applied_seq": 1, "applied": 10}, now=7
    )  # same report
    assert book.allocate(now=7) == {"b": (4, 10)}  # seq 3 revoked a's share


def _running(n: int, demand: int, applied_seq: int, applied: int, chunks: dict | None = None) -> dict:
    """A report of a worker with `applied` in flight (its share) and `chunks` running (none: idle)."""
    return {"n": n, "demand": demand, "in_use": min(demand, applied), "applied_seq": applied_seq,
            "applied": applied, "chunks": {"0": [0, 0]} if chunks is None else chunks}  # fmt: skip


def _halves(book: ShareBook, *names: str) -> dict[str, int]:
    """Workers settled at equal parts of the limit at t=3 s, each past one chunk's end whose tail and gap
    took 0.2 s (fast requests), each applying what the book grants: the seqs they applied. Their reports'
    counters are below 10 by then."""
    names = names or ("a", "b")
    applied = dict.fromkeys(names, (0, 0))
    steps = [(0.0, 1000, None), (0.1, 3, None), (0.2, 0, {})]
    steps += [(0.3 + k / 10, 1000, {"1": [0, 0]}) for k in range(6)]
    for n, (t, demand, chunks) in enumerate(steps, 1):
        for name in names:
            book.update(name, _running(n, demand, *applied[name], chunks=chunks), now=t)
        grants = book.allocate(now=t, queued=4)
        applied = {name: grants[name] for name in names}
    assert {share for _, share in applied.values()} == {book.limit // len(names)}, applied
    return {name: seq for name, (seq, _) in applied.items()}


def test_a_worker_between_chunks_keeps_its_share_while_chunks_are_queued():
    """On Ray a worker process runs one chunk at a time: its chunk ends, the engine starts a queued one
    there within milliseconds. With fast requests its share stays through the chunk's tail and the gap;
    taken away, it came back only two rounds after the next chunk began, at every chunk's end."""
    book = ShareBook(32)
    seq = _halves(book)
    book.update("a", _running(10, 3, seq["a"], 16, chunks={"1": [997, 0]}), now=3.0)  # the tail: 3 left
    book.update("b", _running(10, 1000, seq["b"], 16, chunks={"2": [0, 0]}), now=3.0)
    assert book.allocate(now=3.0, queued=4) == {"a": (seq["a"], 16), "b": (seq["b"], 16)}
    book.update("a", _running(11, 0, seq["a"], 16, chunks={}), now=3.1)  # ended; the next not yet started
    assert book.allocate(now=3.1, queued=4) == {"a": (seq["a"], 16), "b": (seq["b"], 16)}
    book.update("a", _running(12, 1000, seq["a"], 16, chunks={"3": [0, 0]}), now=3.2)  # runs at once at 16
    assert book.allocate(now=3.2, queued=3) == {"a": (seq["a"], 16), "b": (seq["b"], 16)}


def test_a_workers_first_chunk_end_moves_its_share_as_before():
    """Nothing tells yet how long this worker's tails last: its first tail goes to the worker with work."""
    book = ShareBook(32)
    for name in "ab":
        book.update(name, _running(1, 1000, 0, 0), now=0)
    seq = {w: g[0] for w, g in book.allocate(now=0, queued=4).items()}
    book.update("a", _running(2, 3, seq["a"], 16), now=0.1)
    book.update("b", _running(2, 1000, seq["b"], 16), now=0.1)
    assert book.allocate(now=0.1, queued=4)["a"][1] == 3


def test_with_nothing_queued_a_finished_workers_share_goes_where_the_work_is():
    book = ShareBook(32)
    seq = _halves(book)
    book.update("a", _running(10, 0, seq["a"], 16, chunks={}), now=3.0)  # its last chunk ended
    book.update("b", _running(10, 1000, seq["b"], 16), now=3.0)
    grants = book.allocate(now=3.0, queued=0)
    assert grants["a"][1] == 0 and grants["b"][1] == 16  # b waits for a to apply 0
    book.update("a", _running(11, 0, grants["a"][0], 0, chunks={}), now=3.1)
    assert book.allocate(now=3.1, queued=0)["b"][1] == 32


def test_a_long_tail_gives_its_share_up_though_chunks_are_queued():
    """One slow request (minutes of retries) in a chunk's tail: its worker keeps its share NEXT_CHUNK_S,
    not for the whole tail, while the other worker has work for all of it; and its next tail, since this
    one lasted longer, is not kept at all."""
    book = ShareBook(32)
    seq = _halves(book)
    book.update("a", _running(10, 1, seq["a"], 16, chunks={"1": [999, 0]}), now=3.0)
    book.update("b", _running(10, 1000, seq["b"], 16), now=3.0)
    assert book.allocate(now=3.0, queued=60)["a"][1] == 16
    later = 3.0 + NEXT_CHUNK_S
    book.update("b", _running(11, 900, seq["b"], 16), now=later)
    grants = book.allocate(now=later, queued=60)
    assert grants["a"][1] == 1
    book.update("a", _running(11, 1, grants["a"][0], 1), now=later + 0.1)
    grants = book.allocate(now=later + 0.1, queued=60)
    assert grants["b"][1] == 31
    book.update("a", _running(12, 1000, grants["a"][0], 1, chunks={"3": [0, 0]}), now=20.0)  # tail over
    book.update("b", _running(12, 1000, grants["b"][0], 31), now=20.0)
    book.allocate(now=20.0, queued=60)
    assert book.workers["a"].last_tail_s > NEXT_CHUNK_S
    book.update("a", _running(13, 2, grants["a"][0], 1, chunks={"3": [998, 0]}), now=30.0)
    assert book.allocate(now=30.0, queued=60)["a"][1] == 1, "a tail after a slow one was kept"


def test_a_worker_idle_for_longer_gives_its_share_up_though_chunks_are_queued():
    """Queued chunks go to workers with room; one with no chunk of this run for NEXT_CHUNK_S (busy with
    another run's chunks on a shared cluster) is not about to take them."""
    book = ShareBook(32)
    seq = _halves(book)
    book.update("a", _running(10, 0, seq["a"], 16, chunks={}), now=3.0)
    book.update("b", _running(10, 1000, seq["b"], 16), now=3.0)
    assert book.allocate(now=3.0, queued=4)["a"][1] == 16
    book.update("b", _running(11, 1000, seq["b"], 16), now=3.0 + NEXT_CHUNK_S)
    assert book.allocate(now=3.0 + NEXT_CHUNK_S, queued=4)["a"][1] == 0


def test_short_chunks_that_need_less_than_the_share_do_not_renew_it():
    """A worker whose chunks each need less than its share (small or mostly adopted chunks), a new one
    every 0.4 s: its tail goes on through them, and its share goes to the worker with work after
    NEXT_CHUNK_S, not never."""
    book = ShareBook(32)
    seq = _halves(book)
    shares = []
    for k in range(10):
        t = 3.0 + 0.4 * k
        book.update("a", _running(10 + k, 3, seq["a"], 16, chunks={str(10 + k): [0, 0]}), now=t)
        book.update("b", _running(10 + k, 1000, seq["b"], 16), now=t)
        shares.append(book.allocate(now=t, queued=10)["a"][1])
    assert shares[0] == 16 and shares[-1] == 3, shares


def test_a_share_lowered_before_it_is_applied_is_no_tail():
    """A third worker joins: the book lowers a's share before a applies it. a's demand below the share it
    still applies, not below the new one, is not its tail; its real tail, later, is kept."""
    book = ShareBook(32)
    seq = _halves(book)
    book.update("c", _running(1, 1000, 0, 0), now=3.0)
    lowered = book.allocate(now=3.0, queued=4)
    assert lowered["a"][1] == 11
    book.update("a", _running(10, 12, seq["a"], 16, chunks={"1": [988, 0]}), now=3.1)  # 12 < 16, not < 11
    book.allocate(now=3.1, queued=4)
    assert book.workers["a"].tail_at is None
    book.update("a", _running(11, 3, lowered["a"][0], 11, chunks={"1": [997, 0]}), now=4.0)
    assert "a" in book.keeping(4.0, queued=4)


def test_one_worker_keeps_its_share_per_chunk_queued():
    """Three workers' chunks ended with one chunk queued: one of them takes it; the other two give their
    shares to the worker with work at once."""
    book = ShareBook(64)
    seq = _halves(book, "a", "b", "c", "d")
    for i, name in enumerate("abc"):
        book.update(name, _running(10, 0, seq[name], 16, chunks={}), now=3.0 + i / 100)
    book.update("d", _running(10, 1000, seq["d"], 16), now=3.0)
    grants = book.allocate(now=3.1, queued=1)
    assert grants["a"][1] == 16 and grants["b"][1] == grants["c"][1] == 0  # a's chunk ended first


def test_a_dead_workers_report_left_behind_is_no_sign_of_life():
    """A worker that died leaves its last report in the channel, read again every round: it is gone
    once, its share revoked once, not revived and revoked again at every round."""
    book = ShareBook(32, lost_s=10)
    seq = _halves(book)
    last = _running(10, 5, seq["a"], 16)
    t, n = 0.3, 10
    while t < 60:
        t, n = t + 0.1, n + 1
        book.update("a", last, now=t)
        book.update("b", _running(n, 1000, seq["b"], 16), now=t)
        book.allocate(now=t, queued=4)
    assert "a" not in book.workers and len(book.gone["a"].issued) <= 2, book.gone["a"].issued


@dataclass
class Worker:
    """A worker as the engine sees it: it applies whatever answer it last read, and runs up to it."""

    name: str
    demand: int
    applied_seq: int = 0
    applied: int = 0
    in_use: int = 0
    n: int = 0

    def report(self) -> dict[str, Any]:
        self.n += 1
        return {
            "n": self.n,
            "demand": self.demand,
            "in_use": self.in_use,
            "applied_seq": self.applied_seq,
            "applied": self.applied,
            "chunks": {"0": [0, 0]} if self.demand else {},
        }


@settings(max_examples=400, deadline=None)
@given(
    limit=st.integers(1, 40),
    demands=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 60)), max_size=120),
)
def test_requests_in_flight_never_sum_past_the_limit(limit, demands, steps):
    """Reports reach the book late, answers reach workers late or out of turn, work comes and goes, chunks
    are queued or not, time passes (tails and gaps kept and let go): the workers' real in-flight counts,
    bounded only by the share each applied, never sum past the limit. (A worker silent past LOST_S is the
    test below.)"""
    book = ShareBook(limit, lost_s=float("inf"))
    workers = [Worker(f"w{i}", d) for i, d in enumerate(demands)]
    inbox: dict[str, dict[str, Any]] = {}  # the newest report of each worker, waiting for the book
    board: dict[str, tuple[int, int]] = {}  # the book's newest published answer
    now = 0.0
    for who, action, amount in steps:
        worker = workers[who % len(workers)]
        if action == 0:
            inbox[worker.name] = worker.report()
        elif action == 1:
            for name, report in inbox.items():
                book.update(name, report, now=now)
            board = book.allocate(now=now, queued=amount % 3)  # chunks queued or not
        elif action == 2 and worker.name in board:
            seq, share = board[worker.name]
            if seq > worker.applied_seq:
                worker.applied_seq, worker.applied = seq, share
        elif action == 3:
            worker.in_use = min(worker.applied, worker.demand, max(worker.in_use, amount))
        elif action == 4:
            worker.demand = amount
            worker.in_use = min(worker.in_use, amount)
        else:
            now += amount / 100  # up to 0.6 s
        assert sum(max(w.in_use, w.applied) for w in workers) <= limit


def test_a_worker_that_returns_after_it_was_gone_gets_only_what_is_free():
    """a goes silent (a paused process) holding half; after LOST_S its half goes to b. When a resumes, its
    requests have ended at the backend, and it reports the half it last applied: it must not run that
    half again while b runs the whole limit."""
    book = ShareBook(32, lost_s=10)
    a, b = Worker("a", 100), Worker("b", 100)

    def round_at(t: float, *reporting: Worker) -> dict[str, tuple[int, int]]:
        for w in reporting:
            book.update(w.name, w.report(), now=t)
        board = book.allocate(now=t)
        for w in reporting:
            seq, share = board.get(w.name, (0, 0))
            if seq > w.applied_seq:
                w.applied_seq, w.applied = seq, share
            w.in_use = min(w.applied, w.demand)  # requests fill the share at once...
        assert a.in_use + b.in_use <= 32, (board, a, b)
        return board

    t = 0.0
    while a.applied < 16 or b.applied < 16:
        round_at(t, a, b)
        t += 0.1
    a.in_use = 0  # its requests end at the backend while it is paused
    for _ in range(120):
        round_at(t, b)
        t += 0.1
    assert b.applied == 32 and "a" not in book.workers
    assert round_at(t, a, b)["a"][1] == 0  # a resumes: its share was revoked, not its old half
    b.demand = 0  # b's work ends: what it held becomes a's again, never before it drained
    for _ in range(5):
        t += 0.1
        b.in_use = min(b.in_use, b.demand)
        round_at(t, a, b)
    assert a.applied == 32 and book.peak_in_flight <= 32


def test_the_board_counts_chunks_submitted_and_not_yet_running_as_queued():
    """The board tells the book what is queued: a worker whose chunk just ended keeps its share while a
    chunk waits for a worker, and gives it up once the last one runs."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, loop)
        for index in (0, 1, 2):
            board.started(index)  # submitted, as RemoteChunks does, and waiting for a worker
        seqs = {}
        for worker in ("a", "b"):
            channel.exchange(worker, _running(1, 1000, 0, 0, chunks={"0" if worker == "a" else "1": [0, 0]}))
        board.round()
        for worker in ("a", "b"):
            seqs[worker] = board.published["grants"][worker][0]
            assert board.published["grants"][worker][1] == 16
        loop.run_until_complete(asyncio.sleep(0))  # the loop hears chunks 0 and 1 started
        board.book.workers["a"].last_tail_s = 0.2  # its tails are short (the book's tests show how it learns)
        board.forget(0)
        board.forget(1)
        channel.exchange("a", _running(2, 0, seqs["a"], 16, chunks={}))  # a's chunk ended; 2 is queued
        board.round()
        assert board.published["grants"]["a"][1] == 16, "a gave up its share between two chunks"
        board.forget(2)  # chunk 2 runs elsewhere: nothing is queued any more
        board.round()
        assert board.published["grants"]["a"][1] == 0
    finally:
        loop.close()


def test_the_book_says_whether_shares_are_still_moving():
    """Workers read a settled board less often (their link's `settled_s`): the book says `moving` while any
    share it issued is not applied yet or any worker's share is not where the split puts it."""
    book = ShareBook(32)
    book.update("a", _running(1, 1000, 0, 0), now=0.0)
    grants = book.allocate(now=0.0)
    assert grants["a"][1] == 32 and book.moving, "a's share is issued, not applied"
    book.update("a", _running(2, 1000, grants["a"][0], 32), now=0.1)
    book.allocate(now=0.1)
    assert not book.moving
    book.update("b", _running(1, 1000, 0, 0), now=0.2)
    grants = book.allocate(now=0.2)
    assert grants["a"][1] == 16 and grants["b"][1] == 0 and book.moving, "b waits for a to drain"
    drain = {**_running(3, 1000, grants["a"][0], 16), "in_use": 32}  # a applied its cut, not drained yet
    book.update("a", drain, now=0.25)
    grants = book.allocate(now=0.25)
    assert grants["b"][1] == 0 and not book.workers["a"].issued and book.moving, "b still waits for a"
    book.update("a", _running(4, 1000, grants["a"][0], 16), now=0.3)
    grants = book.allocate(now=0.3)
    assert grants["b"][1] == 16 and book.moving, "b's share is issued, not applied"
    book.update("b", _running(2, 1000, grants["b"][0], 16), now=0.4)
    book.allocate(now=0.4)
    assert not book.moving
    book.update("b", _running(3, 5, grants["b"][0], 16), now=0.5)  # b's tail: its share goes to a
    book.allocate(now=0.5)
    assert book.moving


def test_the_board_emits_a_running_chunks_counts_once_per_change():
    """A worker's report is read again every round until it writes the next one: its chunks' counts reach
    the flow's loop (one wake-up each) only when they changed."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    events: list[Any] = []
    unsubscribe = hub.subscribe(lambda e: events.append((e.kind, e.chunk, e.done, e.failed)))
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, loop)
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"0": [10, 1]}))
        for _ in range(5):
            board.round()
        loop.run_until_complete(asyncio.sleep(0))
        mine = [e for e in events if e[1] == 0]
        assert mine == [("attempt", 0, 10, 0), ("rollouts", 0, 0, 1)], mine
        channel.exchange("a", _running(2, 1000, 0, 0, chunks={"0": [20, 1]}))
        board.round()
        board.round()
        loop.run_until_complete(asyncio.sleep(0))
        mine = [e for e in events if e[1] == 0]
        assert mine[2:] == [("attempt", 0, 20, 0), ("rollouts", 0, 0, 1)], mine
        assert [e[0] for e in events].count("workers") == 1
    finally:
        unsubscribe()
        loop.close()


class FinishingLoop:
    """A real loop whose first thread-safe call from the rounds' thread runs `finish` first: the loop
    finishing the chunk while a round, which has read its running counts, is still queueing them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.finish: Any = None

    def call_soon_threadsafe(self, *args: Any) -> Any:
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()
        return self.loop.call_soon_threadsafe(*args)

    def create_future(self) -> Any:
        return self.loop.create_future()


def test_a_rounds_counts_queued_before_a_chunk_finished_never_count_it_again():
    """The rounds run on a thread of their own: a round can read a running chunk's counts, then the chunk
    finishes on the loop before the round's events reach it. Its final counts stand; the stale ones are
    dropped rather than counting the chunk again."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    finishing = FinishingLoop(loop)
    count = RolloutCount(total=212)
    unsubscribe = hub.subscribe(count.add)
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, finishing)  # type: ignore[arg-type]
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"7": [50, 0]}))
        board.round()
        loop.run_until_complete(asyncio.sleep(0))
        # Chunk 7 is read running again, then chunk 8 is new: the loop finishes 7 as the round announces 8.
        channel.exchange("a", _running(2, 1000, 0, 0, chunks={"7": [98, 2], "8": [0, 0]}))
        manifest = ChunkManifest(
            chunk=7, first_task=0, num_tasks=106, rows_expected=106, rows=106, failed=0,
            sha256="", bytes=0, started_at="", committed_at="", wall_s=0.0, attempt=2,
        )  # fmt: skip
        finishing.finish = lambda: board.finish(ChunkOutcome(manifest=manifest, skipped=False))
        board.round()
        assert finishing.finish is None, "the round made no thread-safe call"
        loop.run_until_complete(asyncio.sleep(0))
        counted = (count.done, count.failed, count.chunks)
        assert counted == (106, 0, {8: [0, 0]}), counted
    finally:
        unsubscribe()
        loop.close()


@contextlib.contextmanager
def counted_board() -> Iterator[tuple[ShareBoard, asyncio.AbstractEventLoop, Board, RolloutCount]]:
    """A board on an in-process channel and its own loop, with the progress count its events feed."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    count = RolloutCount(total=500)
    unsubscribe = hub.subscribe(count.add)
    try:
        yield channel, loop, Board(channel, {"http://127.0.0.1:9": 32}, loop), count
    finally:
        unsubscribe()
        loop.close()


def _chunk_counts(board: Board, loop: asyncio.AbstractEventLoop, rounds: int) -> list[Any]:
    events: list[Any] = []
    unsubscribe = hub.subscribe(lambda e: events.append((e.kind, e.done)) if e.chunk == 7 else None)
    try:
        for _ in range(rounds):
            board.round()
            loop.run_until_complete(asyncio.sleep(0))
    finally:
        unsubscribe()
    return events


@pytest.mark.parametrize("again", [2, 1], ids=["the flow's retry", "the engine's own retry"])
def test_a_chunk_run_again_elsewhere_shows_its_new_workers_counts(again: int) -> None:
    """A worker died running chunk 7; its last report stays in the book until it counts as gone. The chunk
    runs again on worker b, which the book knew first (so b's report is read before the dead one's): the
    progress shows b's counts, once, not the dead attempt's again at every round."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, loop)
        channel.exchange("b", _running(1, 1000, 0, 0, chunks={"3": [0, 0, 1]}))
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"7": [80, 0, 1]}))
        assert _chunk_counts(board, loop, 2) == [("attempt", 80), ("rollouts", 0)]
        channel.exchange("b", _running(2, 1000, 0, 0, chunks={"3": [0, 0, 1], "7": [5, 0, again]}))
        shown = _chunk_counts(board, loop, 4)
        assert shown == [("attempt", 5), ("rollouts", 0)], shown
    finally:
        loop.close()


@pytest.mark.parametrize("known_first", ["b", "a"])
def test_a_dead_workers_report_read_with_its_chunks_new_run_never_holds_it(
    monkeypatch: pytest.MonkeyPatch, known_first: str
) -> None:
    """The rounds missed a's reports (a slow scheduler) until a had died and b ran its chunk again: one
    round reads both listings anew. The tie goes to the worker the book knew first; when that is the dead
    one, b's report keeps changing and a's does not, and once a's has been unchanged for SILENT_S longer
    than b's, b's counts are shown."""
    now = [100.0]
    monkeypatch.setattr(book_module.time, "monotonic", lambda: now[0])
    with counted_board() as (channel, loop, board, count):
        for worker in sorted("ab", key=lambda w: w != known_first):
            channel.exchange(
                worker, _running(1, 1000, 0, 0, chunks={"2" if worker == "a" else "3": [0, 0, 1]})
            )
        board.round()
        channel.exchange("a", _running(2, 1000, 0, 0, chunks={"7": [80, 0, 1]}))  # its last report
        for step in range(1, 60):  # b reports every second; a never again
            now[0] = 100.0 + step / 10
            if step % 10 in (0, 1):
                b_chunks = {"3": [0, 0, 1], "7": [5 + step, 0, 1]}
                channel.exchange("b", _running(2 + step, 1000, 0, 0, chunks=b_chunks))
            board.round()
            loop.run_until_complete(asyncio.sleep(0))
            if known_first == "b" and step in (1, SILENT_S * 10):
                assert count.chunks[7][0] == 5 + step, f"{count.chunks[7]} at step {step}"  # b reported then
            if known_first == "a" and step in (1, SILENT_S * 10):
                assert count.chunks[7] == [80, 0], f"{count.chunks[7]} at step {step}: a shown till then"
        assert count.chunks[7] == [5 + 51, 0], count.chunks[7]


def test_a_chunk_abandoned_while_its_worker_still_lists_it_stays_out_of_the_progress() -> None:
    """A chunk that fails for good on the flow's side (its task's retries spent) may still be listed by its
    worker's last report: the rounds after it never count it back in."""
    with counted_board() as (channel, loop, board, count):
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"7": [80, 2, 3, 40, 1]}))
        board.round()
        loop.run_until_complete(asyncio.sleep(0))
        assert (count.done, count.failed) == (80, 2)
        board.abandon(7)
        hub.emit(ProgressEvent("abandoned", chunk=7))  # what the scheduler emits then
        channel.exchange("a", _running(2, 1000, 0, 0, chunks={"7": [90, 2, 3, 40, 1]}))
        board.round()
        loop.run_until_complete(asyncio.sleep(0))
        # Back to its earlier commit's 40 rows and 1 failure, which stand: the dataset holds them.
        assert (count.done, count.failed, count.chunks) == (40, 1, {}), (
            count.done,
            count.failed,
            count.chunks,
        )


def test_a_running_chunk_reads_the_same_from_workers_of_any_version() -> None:
    """Workers of an older rollflow on a long-lived cluster send [done, failed]; later fields are added at
    the end, never in between."""
    assert chunk_entry([7, 1]) == Entry(7, 1, None, None)
    assert chunk_entry([7, 1, 2]) == Entry(7, 1, 2, None)
    assert chunk_entry([7, 1, 2, 40, 3]) == Entry(7, 1, 2, (40, 3))
    assert chunk_entry([7, 1, 2, 40, 3, 99]) == Entry(7, 1, 2, (40, 3))


def test_a_stale_listing_of_an_older_attempt_never_counts_again() -> None:
    """Dead worker a's report of attempt 1 stays in the book for a while. Attempt 2 runs on b (both read
    anew in one round: the newer attempt wins, not the worker the book knew first), then fails; while the
    flow waits to retry it, only a's stale attempt 1 is listed and the progress keeps b's counts. Attempt 3
    is shown as it comes."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, loop)
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"2": [0, 0, 1]}))
        channel.exchange("b", _running(1, 1000, 0, 0, chunks={"3": [0, 0, 1]}))
        board.round()
        channel.exchange("a", _running(2, 1000, 0, 0, chunks={"7": [80, 0, 1]}))
        channel.exchange("b", _running(2, 1000, 0, 0, chunks={"3": [0, 0, 1], "7": [5, 0, 2]}))
        assert _chunk_counts(board, loop, 2) == [("attempt", 5), ("rollouts", 0)]
        channel.exchange("b", _running(3, 1000, 0, 0, chunks={"3": [0, 0, 1]}))  # attempt 2 failed
        assert _chunk_counts(board, loop, 3) == [], "a's stale attempt 1 was shown again"
        channel.exchange("b", _running(4, 1000, 0, 0, chunks={"3": [0, 0, 1], "7": [9, 0, 3]}))
        assert _chunk_counts(board, loop, 2) == [("attempt", 9), ("rollouts", 0)]
    finally:
        loop.close()


def test_an_attempt_that_has_not_read_its_earlier_commit_yet_keeps_the_floor_known() -> None:
    """Attempt 1 on a reads the chunk's earlier commit (40 rows, 1 failed) and reports it; attempt 2 on b
    is listed before it has read it. The chunk is then abandoned: the progress goes back to the 40 and 1
    the dataset holds, not to nothing."""
    with counted_board() as (channel, loop, board, count):
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"7": [45, 0, 1, 40, 1]}))
        board.round()
        channel.exchange("b", _running(1, 1000, 0, 0, chunks={"7": [0, 0, 2]}))
        board.round()
        loop.run_until_complete(asyncio.sleep(0))
        assert count.chunks[7] == [0, 0] and count.floors[7] == (40, 1), (count.chunks, count.floors)
        board.abandon(7)
        hub.emit(ProgressEvent("abandoned", chunk=7))
        assert (count.done, count.failed, count.chunks) == (40, 1, {})


def test_a_listing_another_run_of_the_same_attempt_replaced_is_never_shown_again() -> None:
    """Dead worker a ran attempt 1; its engine ran attempt 1 again on b, whose counts are shown. b's run of
    it then fails and b lists nothing while the flow waits to retry: a's stale listing stays unshown."""
    channel, loop = ShareBoard(), asyncio.new_event_loop()
    try:
        board = Board(channel, {"http://127.0.0.1:9": 32}, loop)
        channel.exchange("a", _running(1, 1000, 0, 0, chunks={"7": [80, 0, 1]}))
        assert _chunk_counts(board, loop, 2) == [("attempt", 80), ("rollouts", 0)]
        channel.exchange("b", _running(1, 1000, 0, 0, chunks={"7": [5, 0, 1]}))
        assert _chunk_counts(board, loop, 2) == [("attempt", 5), ("rollouts", 0)]
        channel.exchange("b", _running(2, 1000, 0, 0, chunks={}))
        assert _chunk_counts(board, loop, 3) == [], "the replaced listing was shown again"
    finally:
        loop.close()
