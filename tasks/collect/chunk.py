"""chunked-collect: collect a chunk's missing rollouts, save them as parts while it runs, commit it."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rollflow.tasks.collect.heap import tune_gc_for_collection
from rollflow.tasks.collect.parts import chunk_part_rollouts, delete_parts, part_dir, write_part
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.collect.rollouts import (
    CollectContext,
    RolloutBatch,
    RolloutKey,
    WorkItem,
    prepare_row,
    run_rollouts,
)
from rollflow.tasks.collect.rows import ChunkSpec, iter_chunk_rows
from rollflow.tasks.collect.settle import OPEN, SETTLED, chunk_outcomes, decide, first_rollouts, marked
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

log = logging.getLogger(__name__)
SETTLE_GROUP_TASKS = 16  # settling: tasks decided together; a group's rest runs beside other groups' first
RUNNER_STOP_S = 5.0  # how long a failed attempt waits for its cancelled requests to end before it goes on


@dataclass
class ChunkOutcome:
    """What a chunk committed; each committed rollout is in exactly one of collected, adopted, resumed.

    collected: requested by this run's chunk attempts (saved parts of a stalled or killed attempt too);
    adopted: saved by tuning's probes and taken over (`probe_sessions`: how many per probing command);
    resumed: already in the chunk's earlier, partly failed commit.
    """

    manifest: ChunkManifest
    skipped: bool
    collected: int = 0
    resumed: int = 0
    probe_sessions: dict[str, int] = field(default_factory=dict)
    parts_left: str | None = None  # committed, but its parts could not be deleted (why)
    core_s: float = 0.0
    task_s: float = 0.0
    endpoints: list[dict[str, Any]] = field(default_factory=list)  # set on workers: their pool.rows()
    worker: dict[str, Any] | None = None  # set on workers: the process's figures so far (collector.py)

    @property
    def adopted(self) -> int:
        return sum(self.probe_sessions.values())


@dataclass
class Adoptable:
    """Rollouts a chunk already holds before asking the backend, by where they came from."""

    kept: dict[RolloutKey, bytes] = field(default_factory=dict)
    probes: dict[RolloutKey, str] = field(default_factory=dict)  # probe-saved keys -> probing session
    resumed: int = 0
    problems: list[str] = field(default_factory=list)
    floor: tuple[int, int] = (0, 0)  # (rows, failed) of the earlier commit when it stands as it is

    def probe_sessions(self) -> dict[str, int]:
        return dict(Counter(self.probes.values()))


class ChunkStalled(Exception):
    """No rollout of the chunk finished for the stall timeout; the task is retried (parts kept)."""


class _Flusher:
    """Row-level resume: saves the rollouts finished since the last save as a part object.

    A kill then costs at most the requests in flight plus one flush interval; the chunk's commit
    replaces the parts. The results dict keeps insertion order, so new results are those past `saved`.
    """

    def __init__(self, ctx: CollectContext, chunk: int, batch: RolloutBatch, saved: int) -> None:
        self.ctx, self.chunk, self.batch, self.saved = ctx, chunk, batch, saved
        self.token = secrets.token_hex(3)
        self.seq = 0

    async def flush(self) -> None:
        keys = list(itertools.islice(self.batch.results, self.saved, None))
        if not keys:
            return
        lines = [self.batch.results[key] for key in keys]
        name = f"flush-{self.token}-{self.seq:05d}"
        ledger = self.ctx.ledger
        await asyncio.to_thread(write_part, ledger.store, ledger.run_id, self.chunk, name, lines)
        self.saved += len(keys)
        self.seq += 1

    async def run(self, runner: asyncio.Task[None]) -> None:
        """Wait for `runner`, flushing every interval and cancelling it if it stops making progress."""
        interval = self.ctx.collection.flush_interval_s
        stall_s = self.ctx.collection.stall_timeout_s
        tick = min(x for x in (interval, stall_s, 1.0) if x > 0)
        last_flush = last_progress = time.monotonic()
        seen = 0
        try:
            while not runner.done():
                await asyncio.wait({runner}, timeout=tick)
                now = time.monotonic()
                progress = len(self.batch.results) + len(self.batch.failures)
                if progress != seen:
                    seen, last_progress = progress, now
                elif stall_s and now - last_progress > stall_s and not runner.done():
                    runner.cancel()
                    await self.flush()
                    raise ChunkStalled(
                        f"chunk {self.chunk}: no rollout finished for {stall_s:g}s; retrying it "
                        f"({self.saved} finished rollouts kept)"
                    )
                if interval and now - last_flush >= interval and not runner.done():
                    await self.flush()
                    last_flush = now
            runner.result()
        except asyncio.CancelledError:
            runner.cancel()
            await asyncio.shield(self.flush())
            raise
        except Exception:  # a stall, a failed flush, the runner's own error: the attempt ends, and so do
            runner.cancel()  # its requests and counts (within RUNNER_STOP_S: a check may ignore the cancel)
            _, pending = await asyncio.wait({runner}, timeout=RUNNER_STOP_S)
            if pending:
                log.warning(
                    "chunk %d: its attempt's requests did not stop within %gs", self.chunk, RUNNER_STOP_S
                )
            raise


def committed_rows(ledger: Ledger, manifest: ChunkManifest) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """The rows a partly failed chunk already holds, so a re-run redoes only its failures.

    Only bytes that still match the manifest are adopted; a changed object is redone whole.
    """
    with ledger.open_chunk(manifest.chunk) as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        return {}, [f"chunk {manifest.chunk}'s data does not match its manifest; all its rollouts are redone"]
    kept: dict[RolloutKey, bytes] = {}
    for line in data.splitlines():
        if line.strip():
            kept[rowjson.read_keyed(line)[1]] = line
    return kept, []


def _adoptable(ctx: CollectContext, chunk: ChunkSpec, previous: ChunkManifest | None) -> Adoptable:
    """Rollouts already done for this chunk (this run's parts, a partly failed commit) and ignored parts."""
    parts = chunk_part_rollouts(ctx.ledger, chunk, ctx.collection.num_repeats)
    found = Adoptable(parts.kept, parts.probes, 0, parts.problems)
    if previous is not None:
        rows, notes = committed_rows(ctx.ledger, previous)
        found.kept.update(rows)
        found.problems += notes
        found.resumed = len(rows)
        if not notes:  # a changed commit is withdrawn by the audit: nothing of it stands
            found.floor = (len(rows), previous.failed)
        for key in rows:  # counted when that commit landed, not again as a probe
            found.probes.pop(key, None)
    return found


async def _delete_parts(ctx: CollectContext, chunk: int) -> str | None:
    """Parts are litter once the commit landed: failing to delete them must not undo the commit."""
    try:
        await asyncio.to_thread(delete_parts, ctx.ledger.store, chunk)
    except Exception as exc:
        note = ctx.scrub(
            f"chunk {chunk} is committed, but its parts under {part_dir(chunk)} could not be deleted "
            f"({type(exc).__name__}: {exc}); they are no longer needed and may be deleted by hand"
        )
        log.warning("%s", note)
        return note
    return None


async def collect_chunk(ctx: CollectContext, chunk: ChunkSpec, attempt: int = 1) -> ChunkOutcome:
    """Collect every missing rollout of `chunk` and commit it; a committed, complete chunk is skipped."""
    t_core = time.perf_counter()
    tune_gc_for_collection()
    previous = await asyncio.to_thread(ctx.ledger.manifest, chunk.index)
    if previous is not None and previous.failed == 0:
        return ChunkOutcome(previous, skipped=True)
    found = await asyncio.to_thread(_adoptable, ctx, chunk, previous)
    kind = ctx.backend.kind.value
    rows = await asyncio.to_thread(
        lambda: list(iter_chunk_rows(ctx.input_url, chunk, ctx.input_options, kind, ctx.collection.overrides))
    )
    started_at = datetime.now(UTC).isoformat()
    t0 = time.perf_counter()
    batch = await _collect_missing(ctx, chunk, rows, found.kept, found.floor)
    settled = _settled(ctx, [task_index for task_index, _ in rows], batch, found)
    keys = [
        (task_index, r)
        for task_index, _ in rows
        for r in range(settled.get(task_index, ctx.collection.num_repeats))
    ]
    data = b"".join(batch.results[key] + b"\n" for key in keys if key in batch.results)
    fail_data = b"".join(batch.failures[key] + b"\n" for key in sorted(batch.failures)) or None
    manifest = _manifest(ctx, chunk, batch, found, len(data), started_at, time.perf_counter() - t0, attempt)
    manifest.settled = settled
    manifest.rows_expected = len(keys)
    if settled:  # rollouts never requested, so progress displays take them out of the plan
        manifest.stats["settled_rollouts"] = chunk.good_rows * ctx.collection.num_repeats - len(keys)
    if ctx.collection.settle_after is not None or ctx.collection.until_learnable is not None:
        outcomes = chunk_outcomes(keys, batch.results, ctx.correct_threshold, batch.rewards)
        manifest.stats["mixed_tasks"] = outcomes.mixed()
    await asyncio.to_thread(ctx.ledger.commit, chunk.index, data, fail_data, manifest)
    parts_left = await _delete_parts(ctx, chunk.index)
    done, failed = len(batch.results), len(batch.failures)
    unasked = manifest.stats.get("settled_rollouts", 0)
    hub.emit(ProgressEvent("chunk", chunk=chunk.index, done=done, failed=failed, run=ctx.run, total=unasked))
    return ChunkOutcome(
        manifest,
        skipped=False,
        collected=len(batch.results) - len(found.probes) - found.resumed,
        resumed=found.resumed,
        probe_sessions=found.probe_sessions(),
        parts_left=parts_left,
        core_s=time.perf_counter() - t_core,
    )


async def _collect_missing(
    ctx: CollectContext,
    chunk: ChunkSpec,
    rows: list[tuple[int, dict[str, Any]]],
    kept: dict[RolloutKey, bytes],
    floor: tuple[int, int] = (0, 0),
) -> RolloutBatch:
    """Run the rollouts `kept` lacks, saving parts as they finish; the batch holds kept and new lines.
    `floor`: (rows, failed) of the chunk's earlier commit, where its progress goes back if it is abandoned."""
    k, first = ctx.collection.num_repeats, first_rollouts(ctx.collection)
    batch = RolloutBatch(results=dict(kept))

    def todo(rollouts: range, group: list[tuple[int, dict[str, Any]]]) -> Iterator[WorkItem]:
        """The rollouts the batch lacks, as they are taken; a row is prepared once for all its rollouts."""
        for task_index, row in group:
            sent = None
            for r in rollouts:
                if (task_index, r) not in batch.results:
                    if sent is None:
                        sent = prepare_row(row, ctx.collection, ctx.backend.sources)
                    yield task_index, sent, r

    async def both_phases(group: list[tuple[int, dict[str, Any]]]) -> None:
        """The group's first rollouts; with settling, then the rest of its tasks left open."""
        await run_rollouts(ctx, todo(range(first), group), batch, chunk=chunk.index)
        if first < k:
            tasks = [task_index for task_index, _ in group]
            decisions = decide(tasks, batch.results, first, ctx.correct_threshold, batch.rewards)
            left = [(t, row) for t, row in group if decisions[t] == OPEN]
            await run_rollouts(ctx, todo(range(first, k), left), batch, chunk=chunk.index)

    async def all_groups() -> None:
        """Settling: groups of tasks at once, so one group's rest runs while others get their first
        rollouts and the limit never drains at a phase boundary; without it, one pass."""
        if first == k:
            return await both_phases(rows)
        async with asyncio.TaskGroup() as tg:
            for i in range(0, len(rows), SETTLE_GROUP_TASKS):
                tg.create_task(both_phases(rows[i : i + SETTLE_GROUP_TASKS]))

    hub.emit(ProgressEvent("attempt", chunk=chunk.index, done=len(kept), run=ctx.run, floor=floor))
    runner = asyncio.create_task(all_groups())
    await _Flusher(ctx, chunk.index, batch, len(kept)).run(runner)
    return batch


def _settled(ctx: CollectContext, tasks: list[int], batch: RolloutBatch, found: Adoptable) -> dict[int, int]:
    """Task -> M for the tasks settled after their first M rollouts; rows past M of a settled task (none
    are ever requested) are dropped, so the commit holds exactly what the rule gives."""
    after = ctx.collection.settle_after
    if after is None:
        return {}
    decisions = decide(tasks, batch.results, after, ctx.correct_threshold, batch.rewards)
    settled = {t: after for t, d in decisions.items() if d == SETTLED}
    for key in [key for key in batch.results if key[0] in settled]:
        if key[1] >= after:
            del batch.results[key]
            found.probes.pop(key, None)
        else:
            batch.results[key] = marked(batch.results[key], after)
    return settled


def _manifest(
    ctx: CollectContext,
    chunk: ChunkSpec,
    batch: RolloutBatch,
    found: Adoptable,
    size: int,
    started_at: str,
    wall_s: float,
    attempt: int,
) -> ChunkManifest:
    """The chunk's manifest before commit (the ledger fills in its hash and commit time)."""
    return ChunkManifest(
        chunk=chunk.index,
        first_task=chunk.first_task,
        num_tasks=chunk.num_tasks,
        rows_expected=chunk.good_rows * ctx.collection.num_repeats,
        rows=len(batch.results),
        failed=len(batch.failures),
        sha256="",
        bytes=size,
        started_at=started_at,
        committed_at="",
        wall_s=round(wall_s, 6),
        attempt=attempt,
        stats={
            **batch.stats.as_dict(),
            "adopted": len(found.probes),
            "resumed": found.resumed,
            "ignored_parts": found.problems,
        },
    )
