"""A reverify chunk: read its source rows, score them again, commit them like a collected chunk.

The commit is the collection's (data object, failures, then the manifest), so a kill at any point leaves
either nothing of the chunk or all of it; a chunk committed with failures redoes only those.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rollflow.tasks.backends.backends import BackendError
from rollflow.tasks.collect.chunk import committed_rows
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.reverify.rescore import (
    failed_line,
    new_reward,
    plain_reward,
    rescored_line,
    row_of_failure,
)
from rollflow.tasks.reverify.source import (
    Mode,
    RolloutKey,
    SourceChunk,
    is_rescorable,
    iter_failed_chunk,
    read_dataset_chunk,
)
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.verify.verifiers import Verifier


@dataclass
class ReverifyContext:
    """What every chunk of one reverify shares in a process."""

    ledger: Ledger
    source_url: str
    mode: Mode
    source_options: dict[str, Any]
    verifier: Verifier
    verifier_name: str
    parallelism: int


@dataclass
class ReverifyOutcome:
    manifest: ChunkManifest
    skipped: bool
    rescored: int = 0
    kept: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def _read(ctx: ReverifyContext, chunk: SourceChunk) -> list[tuple[bytes, bool]]:
    if ctx.mode == "failed":
        return list(iter_failed_chunk(ctx.source_url, chunk, ctx.source_options))
    if ctx.mode == "shards":
        from rollflow.tasks.reverify.shards import read_shards_chunk  # pyarrow: only a Parquet source pays it

        return [(line, False) for line in read_shards_chunk(ctx.source_url, chunk, ctx.source_options)]
    return [(line, False) for line in read_dataset_chunk(ctx.source_url, chunk, ctx.source_options)]


PROGRESS_EVERY = 200  # lines settled between two progress events of a chunk


@dataclass
class _Work:
    """The chunk's lines in, output lines and failure lines out, in source order; every PROGRESS_EVERY
    lines settled, a progress event (`emit`: on the event loop, whichever thread settles them)."""

    ctx: ReverifyContext
    lines: list[tuple[bytes, bool]]
    kept: dict[RolloutKey, bytes]
    chunk: int | None = None
    emit: Callable[[ProgressEvent], None] = hub.emit
    results: list[bytes | None] = field(default_factory=list)
    failures: dict[RolloutKey, bytes] = field(default_factory=dict)
    rescored: int = 0
    parse_s: float = 0.0
    dump_s: float = 0.0
    unsaid: list[int] = field(default_factory=lambda: [0, 0])  # settled since the last event: done, failed

    def _settled(self, i: int) -> None:
        self.unsaid[self.results[i] is None] += 1
        if sum(self.unsaid) >= PROGRESS_EVERY:
            self.say()

    def say(self) -> None:
        done, failed = self.unsaid
        if done or failed:
            self.emit(ProgressEvent("rollouts", done=done, failed=failed, chunk=self.chunk))
            self.unsaid = [0, 0]

    def _row(self, i: int) -> tuple[dict[str, Any], RolloutKey] | None:
        """The row to score at line i, or None when the line's outcome is settled without a check."""
        line, failed = self.lines[i]
        if self.ctx.mode == "failed" and not failed:
            self.results[i] = line  # a committed rollout of the source: not scored again
            return None
        t0 = time.perf_counter()
        parsed, key = rowjson.read_keyed(line)
        if failed and not is_rescorable(parsed):
            self.failures[key] = line  # stays failed
            return None
        row = row_of_failure(parsed) if failed else parsed
        self.parse_s += time.perf_counter() - t0
        if key in self.kept:
            self.results[i] = self.kept[key]
            return None
        return row, key

    def _scored(self, i: int, row: dict[str, Any], key: RolloutKey, reward: float | BackendError) -> None:
        if isinstance(reward, BackendError):
            self.failures[key] = failed_line(row, reward)
            return
        t1 = time.perf_counter()
        self.results[i] = rescored_line(row, reward, self.ctx.verifier_name)
        self.rescored += 1
        self.dump_s += time.perf_counter() - t1

    async def one(self, i: int) -> None:
        found = self._row(i)
        if found is not None:
            row, key = found
            try:
                reward: float | BackendError = await new_reward(self.ctx.verifier, row)
            except BackendError as exc:
                reward = exc
            self._scored(i, row, key, reward)
        self._settled(i)

    def run_plain(self, check: Callable[[dict[str, Any], str], float]) -> None:
        """A check of microseconds: the whole chunk on one thread, no hop to the event loop per row."""
        self.results = [None] * len(self.lines)
        for i in range(len(self.lines)):
            found = self._row(i)
            if found is not None:
                row, key = found
                try:
                    reward: float | BackendError = plain_reward(check, row)
                except BackendError as exc:
                    reward = exc
                self._scored(i, row, key, reward)
            self._settled(i)

    async def run(self) -> None:
        self.results = [None] * len(self.lines)
        todo = iter(range(len(self.lines)))

        async def worker() -> None:
            for i in todo:
                await self.one(i)

        await asyncio.gather(*(worker() for _ in range(min(self.ctx.parallelism, len(self.lines)) or 1)))


async def reverify_chunk(ctx: ReverifyContext, chunk: SourceChunk, attempt: int = 1) -> ReverifyOutcome:
    """Score the chunk's rows and commit them; a committed chunk without failures is skipped."""
    ledger = ctx.ledger
    previous = await asyncio.to_thread(ledger.manifest, chunk.index)
    if previous is not None and previous.failed == 0:
        return ReverifyOutcome(previous, skipped=True)
    kept: dict[RolloutKey, bytes] = {}
    if previous is not None:
        kept, _ = await asyncio.to_thread(committed_rows, ledger, previous)
    started_at = datetime.now(UTC).isoformat()
    hub.emit(ProgressEvent("attempt", chunk=chunk.index))  # a retried chunk counts from 0 again
    t0 = time.perf_counter()
    lines = await asyncio.to_thread(_read, ctx, chunk)
    t1 = time.perf_counter()
    plain = getattr(ctx.verifier, "plain", None)
    loop = asyncio.get_running_loop()
    work = _Work(ctx, lines, kept, chunk.index)
    if plain is not None:  # settled on a thread: its events go to the loop, where displays expect them
        work.emit = lambda event: loop.call_soon_threadsafe(hub.emit, event)
        await asyncio.to_thread(work.run_plain, plain)
    else:
        await work.run()
    work.say()
    t2 = time.perf_counter()
    data = b"".join(line + b"\n" for line in work.results if line is not None)
    fail_data = b"".join(work.failures[key] + b"\n" for key in sorted(work.failures)) or None
    timings = {
        "read_s": round(t1 - t0 + work.parse_s, 6),
        "verify_s": round(max(0.0, t2 - t1 - work.parse_s - work.dump_s), 6),
    }
    manifest = ChunkManifest(
        chunk=chunk.index,
        first_task=chunk.first_task,
        num_tasks=chunk.num_tasks,
        rows_expected=chunk.rows,
        rows=sum(line is not None for line in work.results),
        failed=len(work.failures),
        sha256="",
        bytes=len(data),
        started_at=started_at,
        committed_at="",
        wall_s=0.0,
        attempt=attempt,
        stats={"rescored": work.rescored, "kept": len(kept), **timings},
    )
    t3 = time.perf_counter()
    manifest.wall_s = round(t3 - t0, 6)
    await asyncio.to_thread(ledger.commit, chunk.index, data, fail_data, manifest)
    timings["write_s"] = round(time.perf_counter() - t3 + work.dump_s, 6)
    return ReverifyOutcome(manifest, False, work.rescored, len(kept), timings)
