"""The share book: workers' shares follow their work, and what they can have in flight never sums past the
limit, whatever order reports, answers and requests come in."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.tasks.scaleout.book import ShareBook, water_fill


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


@dataclass
class Worker:
    """A worker as the engine sees it: it applies whatever answer it last read, and runs up to it."""

    name: str
    demand: int
    applied_seq: int = 0
    applied: int = 0
    in_use: int = 0
    n: int = 0

    def report(self) -> dict[str, int]:
        self.n += 1
        return {
            "n": self.n,
            "demand": self.demand,
            "in_use": self.in_use,
            "applied_seq": self.applied_seq,
            "applied": self.applied,
        }


@settings(max_examples=400, deadline=None)
@given(
    limit=st.integers(1, 40),
    demands=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 60)), max_size=120),
)
def test_requests_in_flight_never_sum_past_the_limit(limit, demands, steps):
    """Reports reach the book late, answers reach workers late or out of turn, work comes and goes: the
    workers' real in-flight counts, bounded only by the share each applied, never sum past the limit."""
    book = ShareBook(limit)
    workers = [Worker(f"w{i}", d) for i, d in enumerate(demands)]
    inbox: dict[str, dict[str, int]] = {}  # the newest report of each worker, waiting for the book
    board: dict[str, tuple[int, int]] = {}  # the book's newest published answer
    for who, action, amount in steps:
        worker = workers[who % len(workers)]
        if action == 0:
            inbox[worker.name] = worker.report()
        elif action == 1:
            for name, report in inbox.items():
                book.update(name, report, now=0)
            board = book.allocate(now=0)
        elif action == 2 and worker.name in board:
            seq, share = board[worker.name]
            if seq > worker.applied_seq:
                worker.applied_seq, worker.applied = seq, share
        elif action == 3:
            worker.in_use = min(worker.applied, worker.demand, max(worker.in_use, amount))
        else:
            worker.demand = amount
            worker.in_use = min(worker.in_use, amount)
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
