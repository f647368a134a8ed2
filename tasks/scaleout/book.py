"""The run-wide limit across worker processes: shares of `--parallelism` moved to where the work is.

Each worker process reports a few times a second what it still has to do and what it has in flight; the
book answers with its share. A share taken from a worker stays counted as held until that worker reports
it applied the smaller share and drained below it, so the workers' requests in flight never sum past the
limit while shares move. No request waits on the book: a worker only applies the share it was given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

LOST_S = 10.0  # a worker silent this long is gone: what it held is free again
SHARE_LEASE_S = 5.0  # a worker whose share the book has not confirmed this long drops it (< LOST_S)
NEXT_CHUNK_S = 0.5  # a worker's tail and gap shorter than this keep its share while chunks wait (`keeping`)


@dataclass
class WorkerState:
    """What the book knows of one worker: its last report and the shares issued since it applied one."""

    demand: int = 0
    in_use: int = 0
    applied_seq: int = 0
    applied: int = 0
    seen: float = 0.0
    chunks: frozenset[str] = frozenset()  # the chunks of the run its last report showed running
    tail_at: float | None = None  # when the book first saw its chunks need less than its share (its tail)
    last_tail_s: float | None = None  # how long its last tail and the gap after it lasted (to a new chunk)
    reports: int = -1  # the worker's report counter: a report read twice is not a sign of life
    issued: list[tuple[int, int]] = field(default_factory=list)  # (seq, share), oldest first
    snapshot: dict[str, Any] = field(default_factory=dict)

    @property
    def share(self) -> int:
        """The newest share issued (what the worker will apply next)."""
        return self.issued[-1][1] if self.issued else self.applied

    @property
    def held(self) -> int:
        """The most this worker can have in flight before its next report: its in-flight count, the share
        it applied, and every share issued since (it may apply any of them before reporting again)."""
        pending = [share for seq, share in self.issued if seq > self.applied_seq]
        return max(self.in_use, self.applied, *pending)


def water_fill(total: int, demands: dict[str, int], current: dict[str, int]) -> dict[str, int]:
    """`total` split as evenly as the demands allow (no worker gets more than its demand).

    Units that cannot split evenly go to the workers holding the most already, so shares do not flicker
    between workers from one round to the next.
    """
    shares = dict.fromkeys(demands, 0)
    left = total
    active = sorted((w for w, d in demands.items() if d > 0), key=lambda w: (demands[w], w))
    while active and left > 0:
        each = left // len(active)
        if each == 0:
            by_holding = sorted(active, key=lambda w: (-current.get(w, 0), -demands[w], w))
            for w in by_holding[:left]:
                shares[w] += 1
            break
        unmet = []
        for w in active:
            give = min(each, demands[w] - shares[w])
            shares[w] += give
            left -= give
            if shares[w] < demands[w]:
                unmet.append(w)
        active = unmet
    return shares


class ShareBook:
    """The flow process's record of every worker's share of one limit; `allocate` is one round."""

    def __init__(self, limit: int, lost_s: float = LOST_S) -> None:
        self.limit = limit
        self.lost_s = lost_s
        self.workers: dict[str, WorkerState] = {}
        self.gone: dict[str, WorkerState] = {}
        self.peak_in_flight = 0  # the most the workers reported in flight at once (as sampled by reports)
        self.peak_held = 0  # the most the book allowed at once (never above the limit)
        self.moving = True  # as of the last round: shares are still on their way to where they belong
        self._seq = 0

    def update(self, worker: str, report: dict[str, Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        n = int(report.get("n", 0))
        gone = self.gone.get(worker)
        if worker not in self.workers and gone is not None and n == gone.reports:
            return  # a gone worker's last report read again (a dead one's stays behind): not a return
        state = self.workers.get(worker) or self.gone.pop(worker, None) or WorkerState()
        self.workers[worker] = state
        state.demand = int(report.get("demand", 0))
        state.in_use = int(report.get("in_use", 0))
        state.applied_seq = int(report.get("applied_seq", 0))
        state.applied = int(report.get("applied", 0))
        state.issued = [(seq, share) for seq, share in state.issued if seq > state.applied_seq]
        if n != state.reports:
            state.reports, state.seen = n, now
        chunks = frozenset(report.get("chunks") or {})
        if chunks - state.chunks and state.tail_at is not None:  # a chunk began there after a tail
            state.last_tail_s = now - state.tail_at
            if state.demand >= state.share:  # a chunk that needs less goes on with the tail
                state.tail_at = None
        state.chunks = chunks
        if state.tail_at is None and state.demand < state.share:
            state.tail_at = now
        state.snapshot = report.get("snapshot") or state.snapshot

    def allocate(self, now: float | None = None, queued: int = 0) -> dict[str, tuple[int, int]]:
        """Every worker's newest (seq, share): smaller shares at once, larger ones only from what is free.
        `queued`: the run's chunks submitted to the engine and not yet running on a worker."""
        now = time.monotonic() if now is None else now
        for worker in [w for w, s in self.workers.items() if now - s.seen > self.lost_s]:
            # Revoked before it is given again: should the worker come back, the newest share it finds
            # is 0, not an old one the others now hold, and it grows again only from what is free.
            self._issue(self.workers[worker], 0)
            self.gone[worker] = self.workers.pop(worker)
        current = {w: s.share for w, s in self.workers.items()}
        keeping = self.keeping(now, queued)
        wanted = {w: max(s.demand, s.share) if w in keeping else s.demand for w, s in self.workers.items()}
        target = water_fill(self.limit, wanted, current)
        for worker, state in self.workers.items():
            if target[worker] < state.share:
                self._issue(state, target[worker])
        free = self.limit - sum(s.held for s in self.workers.values())
        for worker in sorted(self.workers, key=lambda w: (current[w] - target[w], w)):
            state = self.workers[worker]
            more = min(target[worker] - state.share, free)
            if more > 0:
                self._issue(state, state.share + more)
                free -= more
        self.moving = any(target[w] != s.share or s.issued for w, s in self.workers.items())
        self.peak_in_flight = max(self.peak_in_flight, sum(s.in_use for s in self.workers.values()))
        self.peak_held = max(self.peak_held, sum(s.held for s in self.workers.values()))
        return {
            w: (s.issued[-1] if s.issued else (s.applied_seq, s.applied)) for w, s in self.workers.items()
        }

    def keeping(self, now: float, queued: int) -> set[str]:
        """Workers that keep their share though their chunks need less, while chunks wait in the engine: in
        their tail or the gap after it for less than NEXT_CHUNK_S, where their last tail and gap lasted less
        than that too (fast requests; slow ones end in longer tails, whose share moves to workers with
        work), at most one per queued chunk (those with no chunk running, then the earliest tails: the
        engine starts a queued chunk on the first worker with room, within milliseconds). Given up, a
        share came back two rounds after the next chunk began: 0.3 s at half the rate at every chunk's end
        on Ray (a worker process runs one chunk at a time) at 50 ms a request."""
        if queued <= 0:
            return set()
        tails = [
            w
            for w, s in self.workers.items()
            if s.tail_at is not None
            and now - s.tail_at < NEXT_CHUNK_S
            and s.last_tail_s is not None
            and s.last_tail_s < NEXT_CHUNK_S
        ]
        tails.sort(key=lambda w: (bool(self.workers[w].chunks), self.workers[w].tail_at, w))
        return set(tails[:queued])

    def set_limit(self, limit: int) -> None:
        """A new run-wide limit (replicas left or rejoined rotation); shares follow in the next rounds."""
        self.limit = max(0, limit)

    def snapshots(self) -> dict[str, dict[str, Any]]:
        """Every worker's last figures, those that left included."""
        return {w: s.snapshot for w, s in {**self.gone, **self.workers}.items() if s.snapshot}

    def _issue(self, state: WorkerState, share: int) -> None:
        self._seq += 1
        state.issued.append((self._seq, share))
