"""Before and after, chunk by chunk: each committed chunk is checked against its manifest and its rows'
old and new rewards are counted in one streaming pass; the chunks' counts merge into the run's."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from rollflow.tasks.collect.settle import SETTLED_AFTER
from rollflow.tasks.publish.audit import AUDIT_DIR, tasks_path
from rollflow.tasks.publish.rewards import RewardStats, TaskRewards
from rollflow.tasks.publish.row_stats import RowStory
from rollflow.tasks.reverify.source import SourceChunk
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

TOP_TASKS = 10
CACHE_VERSION = 6
FAILED = "failed"  # the before side of a rollout the source had no reward for


@dataclass
class _Task:
    """One task's new rewards and its old ones, counted as collection's audit counts a task."""

    after: TaskRewards
    before: TaskRewards
    settled_after: int | None = None  # the collection settled it (--settle-after): its rows say so

    @classmethod
    def at(cls, index: int) -> _Task:
        return cls(TaskRewards(index, 0, 0, 0.0), TaskRewards(index, 0, 0, 0.0))

    def line(self) -> bytes:
        previous = self.before.mean if self.before.rollouts else None
        if self.settled_after is None:
            return self.after.as_line(previous_mean_reward=previous)
        return self.after.as_line(previous_mean_reward=previous, settled_after=self.settled_after)

    def delta(self) -> float | None:
        if not self.after.rollouts or not self.before.rollouts:
            return None
        return self.after.mean - self.before.mean


@dataclass
class ChunkComparison:
    chunk: int
    sha256: str = ""
    rows: int = 0
    failed: int = 0
    committed: bool = True
    sha_matches: bool = True
    invalid: int = 0
    rescored: int = 0
    changed: int = 0
    agreement: dict[str, int] = field(default_factory=dict)
    top: list[list[Any]] = field(default_factory=list)  # [|delta|, task, before mean, after mean]
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    story: dict[str, Any] = field(default_factory=dict)
    settle_after: int | None = None  # the collection's --settle-after, read from a settled task's rows
    short: int = 0  # rollouts its tasks lack: a settled task's first M, any other's max_k, less its rows


@dataclass
class _Pass:
    threshold: float
    max_k: int
    out: ChunkComparison
    before: RewardStats = field(init=False)
    after: RewardStats = field(init=False)
    task: _Task | None = None
    last: tuple[int, int] = (-1, -1)
    lines: list[bytes] = field(default_factory=list)
    story: RowStory = field(default_factory=RowStory)
    only: set[tuple[int, int]] | None = None  # --failed-only: the rollouts this run scored; the rest are kept
    tasks_seen: int = 0

    def __post_init__(self) -> None:
        self.before = RewardStats(threshold=self.threshold, max_k=self.max_k)
        self.after = RewardStats(threshold=self.threshold, max_k=self.max_k)

    def side(self, reward: float | None) -> str:
        if reward is None:
            return FAILED
        return "correct" if reward >= self.threshold else "incorrect"

    def close_task(self) -> None:
        task, self.task = self.task, None
        if task is None or not task.after.rollouts:
            return
        self.lines.append(task.line())
        self.tasks_seen += 1
        self.out.short += max(0, (task.settled_after or self.max_k) - task.after.rollouts)
        settled = task.settled_after is not None
        self.after.add_task(task.after, settled=settled, rescored=True)
        if task.before.rollouts:
            self.before.add_task(task.before, settled=settled, rescored=True)
        delta = task.delta()
        if delta is not None:
            item = [abs(delta), task.after.index, task.before.mean, task.after.mean]
            heapq.heappush(self.out.top, item)
            if len(self.out.top) > TOP_TASKS:
                heapq.heappop(self.out.top)

    def row(self, lineno: int, line: bytes) -> None:
        out = self.out
        out.rows += 1
        try:
            row, key = rowjson.read_keyed(line)
            reward = row["reward"]
            rf = row.get("_rf") or {}
        except (rowjson.RowError, KeyError) as exc:
            out.invalid += 1
            problem = exc.problem if isinstance(exc, rowjson.RowError) else f"it has no {exc}"
            out.problems.append(f"line {lineno}: not a valid output row ({problem})")
            return
        if not rowjson.is_reward(reward) or key <= self.last:
            out.invalid += 1
            out.problems.append(f"line {lineno}: rollout {key} has reward {reward!r} or is out of order")
            return
        self.last = key
        self.story.add(row)
        # a kept row of a source that was itself reverified carries _rf too: it was not scored by this run
        rescored = "reverified_with" in rf if self.only is None else key in self.only
        old = rf.get("previous_reward") if rescored else reward
        old = old if rowjson.is_reward(old) else None
        out.rescored += int(rescored)
        out.changed += int(old is not None and old != reward)
        cell = f"{self.side(old)}>{self.side(reward)}"
        out.agreement[cell] = out.agreement.get(cell, 0) + 1
        if self.task is not None and self.task.after.index != key[0]:
            self.close_task()
        if self.task is None:
            self.task = _Task.at(key[0])
        if rowjson.is_reward(rf.get(SETTLED_AFTER)):
            self.task.settled_after = self.out.settle_after = int(rf[SETTLED_AFTER])
        self.after.add_reward(float(reward))
        self.task.after.add(reward, self.threshold)
        if old is not None:
            self.before.add_reward(float(old))
            self.task.before.add(old, self.threshold)


def compare_chunk(
    ledger: Ledger,
    chunk: SourceChunk,
    manifest: ChunkManifest,
    threshold: float,
    max_k: int,
    only: set[tuple[int, int]] | None = None,
) -> ChunkComparison:
    """Stream one committed chunk: its hash against the manifest, its rows' old and new rewards.

    Kept in audit/ beside the collection's per-chunk results while the object is unchanged.
    """
    cache = f"{AUDIT_DIR}/{chunk.index:05d}.compare.json"
    store = ledger.store
    if store.exists(cache) and store.exists(tasks_path(chunk.index)):
        cached = orjson.loads(store.read_bytes(cache))
        if cached.pop("key") == [manifest.sha256, threshold, max_k, CACHE_VERSION]:
            return ChunkComparison(**cached)
    check = _Pass(threshold, max_k, ChunkComparison(chunk.index, failed=manifest.failed), only=only)
    digest = hashlib.sha256()
    with ledger.open_chunk(chunk.index) as fh:
        for lineno, line in enumerate(fh, start=1):
            digest.update(line)
            check.row(lineno, line)
    check.close_task()
    out = check.out
    out.short += max(0, chunk.num_tasks - check.tasks_seen) * max_k  # tasks with no row at all
    out.sha256 = digest.hexdigest()
    out.sha_matches = out.sha256 == manifest.sha256
    out.before, out.after = check.before.state(), check.after.state()
    out.story = check.story.state()
    del out.problems[20:]
    if not out.sha_matches:
        out.problems.append("its data object changed after commit: the commit was withdrawn; run again")
        ledger.uncommit(chunk.index)
        return out
    store.write_bytes(tasks_path(chunk.index), b"".join(check.lines))
    store.write_bytes(
        cache, orjson.dumps({**asdict(out), "key": [manifest.sha256, threshold, max_k, CACHE_VERSION]})
    )
    return out


@dataclass
class Comparison:
    """The run's verdict and its before/after figures, merged from its chunks."""

    threshold: float
    max_k: int
    rows_expected: int = 0
    rows: int = 0
    failed: int = 0
    invalid: int = 0
    rescored: int = 0
    changed: int = 0
    chunks_total: int = 0
    chunks_committed: int = 0
    changed_chunks: list[int] = field(default_factory=list)
    agreement: dict[str, int] = field(default_factory=dict)
    top: list[list[Any]] = field(default_factory=list)
    before: RewardStats | None = None
    after: RewardStats | None = None
    problems: list[str] = field(default_factory=list)
    story: RowStory = field(default_factory=RowStory)
    settle_after: int | None = None
    short: int = 0  # rollouts the tasks lack, this run's failures among them

    @property
    def missing(self) -> int:
        """Rollouts the source never had (its failures, its undecided tasks' later ones): no rescoring
        makes them; only collecting again does."""
        return max(0, self.short - self.failed)

    @property
    def complete(self) -> bool:
        """Every chunk committed and intact, every row valid (failures aside)."""
        return self.chunks_committed == self.chunks_total and not self.invalid and not self.changed_chunks

    def add(self, part: ChunkComparison) -> None:
        self.rows += part.rows
        self.failed += part.failed
        self.invalid += part.invalid
        self.rescored += part.rescored
        self.changed += part.changed
        self.settle_after = self.settle_after or part.settle_after
        self.short += part.short
        self.chunks_committed += int(part.committed and part.sha_matches)
        if not part.sha_matches:
            self.changed_chunks.append(part.chunk)
        for cell, n in part.agreement.items():
            self.agreement[cell] = self.agreement.get(cell, 0) + n
        self.top = heapq.nlargest(TOP_TASKS, self.top + [list(t) for t in part.top])
        self.problems.extend(f"chunk {part.chunk}: {p}" for p in part.problems[:5])
        if part.story:
            self.story.merge(RowStory.from_state(part.story))
        for name in ("before", "after"):
            if getattr(part, name):
                stats = RewardStats.from_state(getattr(part, name))
                mine = getattr(self, name)
                if mine is None:
                    setattr(self, name, stats)
                else:
                    mine.merge(stats)


def compare_run(
    ledger: Ledger,
    chunks: list[SourceChunk],
    manifests: dict[int, ChunkManifest],
    threshold: float,
    max_k: int,
    rescorable: Callable[[SourceChunk], set[tuple[int, int]]] | None = None,
) -> Comparison:
    summary = Comparison(threshold, max_k, chunks_total=len(chunks))
    for chunk in chunks:
        summary.rows_expected += chunk.rows
        manifest = manifests.get(chunk.index)
        if manifest is None:
            summary.add(ChunkComparison(chunk.index, committed=False))
            summary.problems.append(f"chunk {chunk.index}: not committed")
            continue
        only = None if rescorable is None else rescorable(chunk)
        part = compare_chunk(ledger, chunk, manifest, threshold, max_k, only)
        if part.rows + part.failed != chunk.rows:  # published means exactly the plan's rollouts
            part.invalid += 1
            part.problems.append(
                f"holds {part.rows + part.failed:,} rollouts where the plan has {chunk.rows:,}"
            )
        summary.add(part)
    return summary
